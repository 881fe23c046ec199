"""Activation offload (ac=offload): each block's checkpointed input waits in CPU memory for its backward.

With ac=full a block keeps only its input between forward and backward, and recomputes the rest;
those inputs are what is left on the GPU, one (B, T, C) tensor per layer (36 KB a token in fp32
for GPT-2 small). Offload moves each of them to pinned CPU memory as the forward passes (on a
side stream, while the next block computes) and brings it back one block ahead of the backward:
when block i's recomputation asks for its input, block i - 1's starts its copy back, so that it
overlaps block i's backward. The GPU then holds two blocks' inputs, not n_layer.

It works through saved-tensor hooks around torch's (non-reentrant) checkpoint, which saves the
block's inputs with save_for_backward: the hooks see those saves and nothing inside the block,
where checkpoint's own hooks stand. On the CPU (the tests) the same steps run with plain copies.
"""

import weakref

import torch


class _Parked:
    """One offloaded tensor: its CPU copy, and its copy back on the GPU once fetched."""

    __slots__ = ("host", "device", "back", "ready", "previous", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, previous: "_Parked | None"):
        self.host, self.device = host, device
        self.back: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        # the block before this one: fetched next in the backward. Weak: the autograd graph owns
        # each _Parked, and frees it (its pinned buffer with it) when its backward is done
        self.previous = None if previous is None else weakref.ref(previous)


class Offload:
    """Saved-tensor hooks that park floating-point block inputs in CPU memory (`hooks()` around each
    checkpointed block; `new_forward()` before each forward)."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: weakref.ref | None = None  # the most recent _Parked of this forward

    def new_forward(self) -> None:
        self._last = None

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, t: torch.Tensor):
        if not t.is_floating_point():  # positions and document ids: small, left where they are
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        if t.is_cuda:
            side = self._stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # t's memory is not reused before the copy has read it
        else:
            host.copy_(t)
        parked = _Parked(host, t.device, None if self._last is None else self._last())
        self._last = weakref.ref(parked)
        return parked

    def _unpack(self, parked):
        if isinstance(parked, torch.Tensor):
            return parked
        t = self._fetch(parked)
        previous = parked.previous and parked.previous()
        if previous is not None:
            self._start_copy_back(previous)  # overlaps this block's recomputation and backward
        return t

    def _start_copy_back(self, parked: _Parked) -> None:
        if parked.back is not None:
            return
        if parked.device.type != "cuda":
            parked.back = parked.host.clone()
            return
        side = self._stream(parked.device)
        with torch.cuda.stream(side):  # after the copy out, which ran on this stream too
            parked.back = parked.host.to(parked.device, non_blocking=True)
            parked.ready = torch.cuda.Event()
            parked.ready.record(side)

    def _fetch(self, parked: _Parked) -> torch.Tensor:
        self._start_copy_back(parked)
        t, parked.back = parked.back, None  # the host copy stays: a second backward fetches it again
        if parked.ready is not None:
            current = torch.cuda.current_stream(parked.device)
            current.wait_event(parked.ready)
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return t
