"""The KV cache of generation and how each attention decodes against it: every layer's keys and
values so far, so that a new token costs one token's forward, not the whole window's.

    prefill:  the prompt's forward, as in training (the attention's own kernel, causal over the
              prompt), each layer writing its K and V into the cache;
    decode:   one token's forward; each layer appends its K and V and attends the cache through
              its attention's `decode` (model/attention.py's registry), with the attention's score
              modifications and sinks: triton_decode (kernels/decode.py) for attn=triton,
              dense_decode over the cached slice for the others.

The number of positions filled lives on the device (`length`), read by the decode kernel and
advanced in place, so that one decode step can be captured in a CUDA graph and replayed for
every token (GPT.generate): its launches then cost one graph launch, where eager decoding
spends tens of microseconds of Python per kernel (model/gpt.py).
"""

from collections.abc import Callable
from typing import Protocol

import torch

from kernels.decode import decode_attention
from kernels.score_mods import ScoreMods


class DecodeFn(Protocol):
    """(q (B, H, T, D), k_cache, v_cache (B, H_kv, max_len, D), length (1,) int32 on the device, its host
    copy filled, window, mods= the score modifications or None, sinks= (H,) sink logits or None) ->
    (B, H, T, D): the T newest positions, the last T of the `filled`, against the cache."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor,
                 filled: int, window: int = 0, *, mods: ScoreMods | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class KVCache:
    """Keys and values (n_layer, B, H_kv, max_len, D) in the dtype the first layer hands in, and the
    positions filled: `length` (int32, on the device) and `filled` (its host copy, for the eager paths)."""

    def __init__(self, n_layer: int, batch: int, kv_heads: int, max_len: int, head_dim: int, device: torch.device):
        self.shape = (n_layer, batch, kv_heads, max_len, head_dim)
        self.max_len = max_len
        self.k: torch.Tensor | None = None  # allocated at the first append, in k's dtype (autocast's)
        self.v: torch.Tensor | None = None
        self.length = torch.zeros(1, dtype=torch.int32, device=device)
        self.filled = 0

    def positions(self, T: int) -> torch.Tensor:
        """(T,) int64: the positions of T new tokens, on the device (graph-safe: no host read)."""
        return self.length.long() + torch.arange(T, device=self.length.device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, H_kv, T, D) at `positions`; returns the layer's caches (B, H_kv, max_len, D)."""
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros_like(self.k)
        self.k[layer].index_copy_(2, positions, k.to(self.k.dtype))
        self.v[layer].index_copy_(2, positions, v.to(self.v.dtype))
        return self.k[layer], self.v[layer]

    def advance(self, T: int) -> None:
        """After every layer has appended T tokens."""
        self.length.add_(T)
        self.filled += T


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor, filled: int,
                 window: int = 0, *, attend: Callable[..., torch.Tensor], mods: ScoreMods | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decoding with an attention that has no cache kernel: `attend` (q, k, v, window=) over the cache's
    filled slice, the T new queries its newest positions. mods and sinks reach it as keywords only when
    set, so an attend that takes neither still decodes without them. The slice's length is read on the
    host: eager only (no CUDA graph)."""
    extra = {}
    if mods:
        extra["mods"] = mods
    if sinks is not None:
        extra["sinks"] = sinks
    return attend(q, k_cache[:, :, :filled], v_cache[:, :, :filled], window=window, **extra)


def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor, filled: int,
                  window: int = 0, *, mods: ScoreMods | None = None, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Our FlashDecoding kernel (kernels/decode.py), score modifications and sinks included: reads the
    length on the device, so a CUDA graph can replay it."""
    return decode_attention(q, k_cache, v_cache, length, window, mods=mods, sinks=sinks)
