"""Ring attention: causal attention over one sequence split across the ranks of a process group.

Each of the N ranks holds T/N tokens of q, k and v, never the whole sequence; the K/V shards
travel around the ring (rank r sends to r + 1, receives from r - 1) while each rank runs our
FlashAttention kernels on the block in hand, and the next transfer is in flight during that
compute. Partial outputs are merged in fp32 from their LSEs (the forward returns
LSE = log sum exp, so softmax over the union of two key sets is a weighted sum of the two
partial outputs). The backward runs the ring again: with the final O and LSE every block's
gradients are exact pieces of the whole (P = exp(s - LSE) and delta = rowsum(dO · O) are the
global ones); dQ stays home, dK/dV sums travel with their K/V back to the rank that owns them
(the last hop, complete, in K/V's dtype), in fp32 only where a third term will join them. Every
sum is taken in a fixed order: the backward is bit-identical run to run, like the kernels'. A
buffer is let go as soon as it is read, a sent one once it has arrived.

Layout, zigzag (load-balanced, as in ring-flash-attention and torchtitan's context parallel):
the T tokens are cut into 2N chunks of c = T / (2N); rank r holds chunks r and 2N-1-r, in that
order (trainer/parallel.py shards and reorders). Then every step costs the same work on
every rank, c·2c query-key pairs or a causal 2c·2c block:
  step 0, own K/V:   local causal attention (chunk order follows global order);
  K/V of rank j < r: all 2c local queries attend chunk j (the first half of that K/V), no mask;
  K/V of rank j > r: the local later chunk 2N-1-r attends all 2c keys, no mask;
every other pair is in the future and skipped, not masked.
"""

import torch
import torch.distributed as dist

from kernels.api import flash_attention, flash_attn_backward, flash_attn_forward
from kernels.inputs import autocast_inputs, empty_bhtd, softmax_scale_of


class _Transfer:
    """Tensors on their way one rank along the ring: keeps the sent ones alive until done."""

    def __init__(self, sent: tuple[torch.Tensor, ...], received: list[torch.Tensor], requests: list):
        self.sent, self.received, self.requests = sent, received, requests

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        # delivered: the transfer lets go of every tensor (a request holds its own too), so that each
        # goes as soon as its caller drops it
        received, self.sent, self.requests, self.received = self.received, (), (), ()
        return received


class _Ring:
    """Asynchronous shifts of tensors one rank along the ring of a process group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, *tensors: torch.Tensor) -> _Transfer:
        """Starts sending tensors to the next rank and receiving as many from the previous one;
        batched, so that NCCL pairs every send with its receive whatever the order of the ranks."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return _Transfer(tensors, received, dist.batch_isend_irecv(ops))


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out (fp32, ..., T, D) and lse (..., T) become the softmax over both key sets, in place."""
    merged = torch.logaddexp(lse, block_lse)
    # addcmul_: no product buffer, and on CUDA no fp32 copy of block_out (the CPU makes one)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).addcmul_(block_out, torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _block(ring: _Ring, step: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of this rank's work at a ring step (module docstring)."""
    j = (ring.rank - step) % ring.size  # whose K/V is in hand
    if step == 0:
        return slice(None), slice(None), True
    if j < ring.rank:
        return slice(None), slice(None, c), False  # every query, the earlier chunk of rank j
    return slice(c, None), slice(None), False  # the later chunk's queries, both of rank j's chunks


def _ring_forward(q, k, v, scale, ring, backend):
    """(o in q's dtype, lse fp32 (B, H, 2c)) of this rank's queries over the whole sequence."""
    c = q.shape[2] // 2
    kv = (k.contiguous(), v.contiguous())  # P2P sends whole buffers
    out = lse = None
    for step in range(ring.size):
        if step < ring.size - 1:
            incoming = ring.shift(*kv)
        rows, keys, causal = _block(ring, step, c)
        o, block_lse = flash_attn_forward(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal=causal,
                                          softmax_scale=scale, backend=backend)
        if step == 0:
            out, lse = o.float(), block_lse
        else:
            _merge(out[:, :, rows], lse[:, :, rows], o, block_lse)
        del o  # each buffer goes as soon as it is read: the next one is made without it
        if step < ring.size - 1:
            kv = tuple(incoming.wait())
    del kv
    return out.to(q.dtype), lse


def _ring_backward(do, q, k, v, o, lse, scale, ring, backend):
    """(dq, dk, dv) of this rank's shards, typed like q, k, v."""
    c, n = q.shape[2] // 2, ring.size
    # the kernels read LSE as a dense (B, H, T): the later chunk's rows copied once (and a group of
    # heads' LSE, a strided view, whole)
    lse_of = {None: lse.contiguous(), c: lse[:, :, c:].contiguous()}
    kv = (k.contiguous(), v.contiguous())
    # A sum is held in fp32 only once a third term will join it: PyTorch adds two bf16 tensors in
    # fp32 and rounds once, the bits of an fp32 sum rounded at the end. So a dK/dV sum leaves its
    # owner (one term) in K/V's dtype, and with 2 ranks dQ and every sum stay in the inputs' dtype.
    dq = dkv = passing = None  # dkv: dK/dV of the K/V in hand as the ranks before summed them
    for step in range(n):
        if step < n - 1:
            incoming = ring.shift(*kv)
        rows, keys, causal = _block(ring, step, c)
        dq_b, dk_b, dv_b = flash_attn_backward(do[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                               o[:, :, rows], lse_of[rows.start], causal=causal, softmax_scale=scale,
                                               backend=backend)
        if step == 0:  # own K/V, every query and key (_block): the sums start here, dense as P2P sends them
            dq = dq_b if n <= 2 else dq_b.float()
            dkv = [dk_b.contiguous(), dv_b.contiguous()]
        else:
            dq[:, :, rows] += dq_b
            dkv = passing.wait()  # sent by the previous rank after its last step: overlapped with ours
            if step == 1 and n > 2:  # a third term will follow
                dkv = [t.float() for t in dkv]
            dkv[0][:, :, keys] += dk_b
            dkv[1][:, :, keys] += dv_b
        del dq_b, dk_b, dv_b
        if step == n - 1:
            del kv
            # the sums are complete and the owner only rounds them: rounded here, the last hop (the
            # one no compute hides) carries the same values at half the bytes
            dkv = [dkv[0].to(k.dtype), dkv[1].to(v.dtype)]
        passing = ring.shift(*dkv)  # on to the next holder; after the last step, to the owner
        if step < n - 1:
            kv = tuple(incoming.wait())
    dk, dv = passing.wait()
    return dq.to(q.dtype), dk, dv


def _heads(t: torch.Tensor, groups: int, g: int) -> torch.Tensor:
    """Group g of t's heads (dim 1) cut into `groups` equal groups: a view."""
    return t.unflatten(1, (groups, -1))[:, g]


def _forward(q, k, v, scale, ring, backend, groups: int = 1):
    """_ring_forward, one ring pass per group of heads: every buffer of a pass is 1/groups the size."""
    if groups == 1:
        return _ring_forward(q, k, v, scale, ring, backend)
    # o in the kernels' (B, T, H, D) memory order, as one pass returns it, whatever q's: after RoPE
    # q is (B, H, T, D)-contiguous, and the model's transpose back would copy o (one more per layer)
    o, lse = empty_bhtd(*q.shape, q), q.new_empty(q.shape[:3], dtype=torch.float32)
    for g in range(groups):
        o_g, lse_g = _ring_forward(*(_heads(t, groups, g) for t in (q, k, v)), scale, ring, backend)
        _heads(o, groups, g).copy_(o_g)
        _heads(lse, groups, g).copy_(lse_g)
        del o_g, lse_g  # not held through the next pass
    return o, lse


def _backward(do, q, k, v, o, lse, scale, ring, backend, groups: int = 1):
    """_ring_backward, one ring pass per group of heads."""
    if groups == 1:
        return _ring_backward(do, q, k, v, o, lse, scale, ring, backend)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for g in range(groups):
        got = _ring_backward(*(_heads(t, groups, g) for t in (do, q, k, v, o, lse)), scale, ring, backend)
        for grad, part in zip(grads, got, strict=True):
            _heads(grad, groups, g).copy_(part)
        del got, part  # not held through the next pass
    return grads


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, ring, backend, groups):
        o, lse = _forward(q, k, v, scale, ring, backend, groups)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.ring, ctx.backend, ctx.groups = scale, ring, backend, groups
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return *_backward(do, q, k, v, o, lse, ctx.scale, ctx.ring, ctx.backend, ctx.groups), None, None, None, None


def _prepare(q, k, v, group, softmax_scale, head_groups: int = 1):
    if q.shape[2] % 2 or q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must hold the same even number "
                         "of tokens: two zigzag chunks of the sequence")
    if head_groups < 1 or k.shape[1] % head_groups:
        raise ValueError(f"ring_attention: head_groups={head_groups} must be a positive divisor of k's {k.shape[1]} "
                         "heads")
    return softmax_scale_of(q, softmax_scale), _Ring(group)


def ring_attn_forward(q, k, v, group: dist.ProcessGroup, softmax_scale=None, backend="auto", head_groups=1):
    """(o, lse) of this rank's queries, as flash_attn_forward gives for those rows; no autograd."""
    return _forward(q, k, v, *_prepare(q, k, v, group, softmax_scale, head_groups), backend, head_groups)


def ring_attn_backward(do, q, k, v, o, lse, group: dist.ProcessGroup, softmax_scale=None, backend="auto",
                       head_groups=1):
    """(dq, dk, dv) of this rank's shards from ring_attn_forward's o and lse; deterministic."""
    return _backward(do, q, k, v, o, lse, *_prepare(q, k, v, group, softmax_scale, head_groups), backend,
                     head_groups)


@torch.compiler.disable  # point-to-point communication inside: compiled models call it eagerly
def ring_attention(q, k, v, group: dist.ProcessGroup, softmax_scale=None, backend="auto", head_groups=1):
    """Causal attention of a sequence held zigzag-sharded over `group` (see the module docstring).

    q (B, H, 2c, D) and k, v (B, H_kv, 2c, D) are this rank's chunks r and 2N-1-r of the whole
    sequence's q, k and v, in that order; returns this rank's (B, H, 2c, D) of the output, equal
    to those rows of flash_attention over the whole sequence, run by the same backend. Every rank
    of the group must call it, in the same order. With one rank it is flash_attention.
    head_groups (dividing H_kv): the heads go round the ring in this many groups, one after the
    other; the ring's buffers shrink as many times, for more and smaller transfers and kernels.
    Heads never mix: the results are those of one pass, up to fp32 rounding in the forward's merges.
    """
    q, k, v = autocast_inputs(q, k, v)
    if dist.get_world_size(group) == 1:
        return flash_attention(q, k, v, causal=True, softmax_scale=softmax_scale, backend=backend)
    return RingAttentionFunction.apply(q, k, v, *_prepare(q, k, v, group, softmax_scale, head_groups), backend,
                                       head_groups)
