"""flash_attention and its two halves: checked inputs, one launch per direction, autograd.

q (B, H, T, D), k and v (B, H_kv, S, D), H % H_kv == 0 (GQA: query head h reads kv head
h // (H / H_kv)), causal bottom-right aligned, optional packed documents and a sliding window
(kernels/masking.py). O, dQ, dK, dV are (B, T, H, D) in memory, returned as (B, H, T, D) views.
Optional score modifications (mods, kernels/score_mods.py's ScoreMods: a softcap C tanh(s / C) and
ALiBi's per-head bias on the scaled scores s) and sinks (H,): a learnable logit per query head,
in units of s, that joins every row's softmax and attends nothing; its gradient comes back in its
dtype. Each direction runs the kernels kernels/backends.py chooses for the caller's backend
("auto", "triton" or "gluon"): kernels/triton/ (any GPU, and the CPU through Triton's
interpreter, whose bf16 tl.dot is wrong: there bf16 is computed in fp32 and rounded) or
kernels/hopper/ (sm_90; with sinks, but no softcap, ALiBi or prefix). The backward is deterministic: the same
bits every run.
"""

import functools

import torch

from kernels import backends
from kernels.inputs import (OFF, autocast_inputs, check_inputs, checked_bounds, checked_mods, empty_bhtd, layout,
                            softmax_scale_of)
from kernels.masking import Bounds
from kernels.runtime.launch import interprets
from kernels.score_mods import ScoreMods, kernel_slopes
from kernels.triton import bwd, fwd


@functools.cache
def _hopper(direction: str):
    """kernels/hopper/fwd.py or bwd.py, imported on first use: they are written in the Gluon of the
    Triton release kernels/hopper/config.py's TRITON names, which other releases need not have."""
    if direction == "forward":
        from kernels.hopper import fwd as hopper_fwd
        return hopper_fwd
    from kernels.hopper import bwd as hopper_bwd
    return hopper_bwd


def _bf16_in_interpreter(q) -> bool:
    """bf16 inputs that Triton's interpreter would run: its bf16 tl.dot is wrong."""
    return q.dtype == torch.bfloat16 and interprets(q.device)


def _signature(tensors: tuple, causal: bool, scale: float, bounds: Bounds | None, backend: str, mods: ScoreMods,
               sinks, prefix: int) -> tuple:
    """What a call's kernels and launches depend on, and the key they are kept by: the tensors'
    layouts (the outputs are fresh from torch's allocator, 512-byte aligned, shaped by them), the
    flags, the bounds' layout, the backend, and the modifications (ALiBi's slopes follow from H;
    whether there is a prefix decides which kernels can run)."""
    return (*layout(*tensors), causal, scale, None if bounds is None else layout(*bounds), backend,
            mods.softcap, mods.alibi, None if sinks is None else layout(sinks), prefix > 0)


def _mod_operands(q, mods: ScoreMods, sinks):
    """(ALiBi's slopes, sinks) as the kernels read them: (H,) fp32, or None."""
    alibi = kernel_slopes(q.shape[1], q.device) if mods.alibi else None
    return alibi, None if sinks is None else sinks.detach().float().contiguous()


def _forward(q, k, v, causal, scale, bounds, backend, mods=OFF, sinks=None, prefix=0):
    """(o, lse) of checked inputs; prefix: the P the bounds hold (only the portable kernels take one)."""
    if _bf16_in_interpreter(q):
        o, lse = _forward(q.float(), k.float(), v.float(), causal, scale, bounds, backend, mods, sinks, prefix)
        return o.to(torch.bfloat16), lse
    B, H, T, D = q.shape
    o = empty_bhtd(B, H, T, D, q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    alibi, sinks = _mod_operands(q, mods, sinks)
    signature = _signature((q, k, v), causal, scale, bounds, backend, mods, sinks, prefix)
    if backends.kernels_for("forward", signature, (q, k, v), backend, bool(mods) or prefix > 0) == "gluon":
        key_lo = None if bounds is None else bounds.key_lo
        _hopper("forward").forward(q, k, v, o, lse, causal, scale, key_lo, signature, sinks)
    else:
        key_band = None if bounds is None else bounds.keys
        fwd.forward(q, k, v, o, lse, causal, scale, key_band, signature, mods.softcap, alibi, sinks)
    return o, lse


def _backward(do, q, k, v, o, lse, causal, scale, bounds, backend, mods=OFF, sinks=None, prefix=0):
    """(dq, dk, dv) of checked inputs, and with sinks their gradient (H,) in their dtype last."""
    if _bf16_in_interpreter(q):
        grads = _backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, scale, bounds, backend,
                          mods, sinks, prefix)
        return *(g.to(torch.bfloat16) for g in grads[:3]), *grads[3:]
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    dq, dk, dv = empty_bhtd(B, H, T, D, q), empty_bhtd(B, H_kv, S, D, k), empty_bhtd(B, H_kv, S, D, v)
    alibi, sinks32 = _mod_operands(q, mods, sinks)
    signature = _signature((q, k, v, do, o, lse), causal, scale, bounds, backend, mods, sinks32, prefix)
    # a sink changes only the LSE, which P is recomputed from: the Hopper backward runs unchanged
    if backends.kernels_for("backward", signature, (q, k, v, do), backend, bool(mods) or prefix > 0) == "gluon":
        _hopper("backward").backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, bounds, signature)
        # its delta stays in its own scratch layout: the sinks' gradient reads it anew, one pass over O and dO
        delta = None if sinks is None else (o.float() * do.float()).sum(-1)
    else:
        delta = bwd.backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, bounds, signature, mods.softcap,
                             alibi)
    if sinks is None:
        return dq, dk, dv
    # d LSE / d sink is the sink's probability: dsink_h = -sum_{b,i} exp(sink_h - LSE_bhi) delta_bhi
    dsinks = -(torch.exp(sinks32[:, None] - lse) * delta).sum((0, 2))
    return dq, dk, dv, dsinks.to(sinks.dtype)


def flash_attn_forward(q, k, v, causal=True, softmax_scale=None, doc_ids=None, window=0, backend="auto", mods=None,
                       sinks=None, prefix=0):
    """(o (B, H, T, D) in q's dtype, lse (B, H, T) fp32 in natural log, the sinks' logits included),
    without autograd."""
    backends.check_backend(backend)
    bounds = checked_bounds(q, k, v, causal, doc_ids, window, prefix)
    mods = checked_mods(q, mods, sinks)
    return _forward(q, k, v, causal, softmax_scale_of(q, softmax_scale), bounds, backend, mods, sinks, prefix)


def flash_attn_backward(do, q, k, v, o, lse, causal=True, softmax_scale=None, doc_ids=None, window=0,
                        backend="auto", mods=None, sinks=None, prefix=0):
    """(dq, dk, dv), shaped and typed like q, k, v, from the forward's o and lse; with sinks,
    (dq, dk, dv, dsinks), dsinks shaped and typed like sinks. Deterministic."""
    backends.check_backend(backend)
    bounds = checked_bounds(q, k, v, causal, doc_ids, window, prefix)
    mods = checked_mods(q, mods, sinks)
    for name, t, like in (("do", do, q), ("o", o, q)):
        if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"flash_attn_backward: {name} must be shaped and typed like q {tuple(like.shape)} "
                             f"{like.dtype}, got {getattr(t, 'shape', type(t).__name__)}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"flash_attn_backward: lse must be the forward's float32 {tuple(q.shape[:3])} tensor")
    return _backward(do, q, k, v, o, lse, causal, softmax_scale_of(q, softmax_scale), bounds, backend, mods, sinks,
                     prefix)


# --------------------------------------------------------------------------------------------
# torch.library ops, autograd, public entry point

# Under torch.compile the launchers run inside custom ops, opaque nodes with shape-only fake
# implementations, so a compiled model keeps one graph; their backward is registered with
# register_autograd (Dynamo cannot trace a hand-written autograd.Function whose q, k and v are
# one tensor). They are registered with define/impl, whose dispatch calls the Python function
# directly (torch.library.custom_op wraps it in more Python per call). Eager calls take a plain
# autograd.Function: any dispatch costs host time that short sequences cannot hide
# (docs/perf-notes.md). Both take the Bounds of documents, windows and a prefix from flash_attention
# (kernels/masking.py: made once per batch or shape in eager calls), and the prefix's P, which
# decides the kernels. The ops take a ScoreMods as its two fields; the backward's fourth output is
# the sinks' gradient, empty without sinks (an op returns tensors).

torch.library.define("kernels::flash_attn_fwd", "(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
                     "Tensor? key_band, Tensor? row_band, str backend, float softcap=0., bool alibi=False, "
                     "Tensor? sinks=None, int prefix=0) -> (Tensor, Tensor)")
torch.library.define("kernels::flash_attn_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                     "bool causal, float scale, Tensor? key_band, Tensor? row_band, str backend, float softcap=0., "
                     "bool alibi=False, Tensor? sinks=None, int prefix=0) -> (Tensor, Tensor, Tensor, Tensor)")


@functools.cache
def _mods(softcap: float, alibi: bool) -> ScoreMods:
    return ScoreMods(softcap, alibi) or OFF


def _bounds(key_band, row_band) -> Bounds | None:
    return None if key_band is None else Bounds(key_band, row_band)


@torch.library.impl("kernels::flash_attn_fwd", ("cpu", "cuda"))
def _flash_attn_fwd_op(q, k, v, causal, scale, key_band, row_band, backend, softcap=0.0, alibi=False, sinks=None,
                       prefix=0):
    return _forward(q, k, v, causal, scale, _bounds(key_band, row_band), backend, _mods(softcap, alibi), sinks,
                    prefix)


@torch.library.register_fake("kernels::flash_attn_fwd")
def _(q, k, v, causal, scale, key_band, row_band, backend, softcap=0.0, alibi=False, sinks=None, prefix=0):
    check_inputs(q, k, v)
    B, H, T, D = q.shape
    return empty_bhtd(B, H, T, D, q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.impl("kernels::flash_attn_bwd", ("cpu", "cuda"))
def _flash_attn_bwd_op(do, q, k, v, o, lse, causal, scale, key_band, row_band, backend, softcap=0.0, alibi=False,
                       sinks=None, prefix=0):
    grads = _backward(do, q, k, v, o, lse, causal, scale, _bounds(key_band, row_band), backend, _mods(softcap, alibi),
                      sinks, prefix)
    return *grads[:3], grads[3] if sinks is not None else q.new_empty(0)


@torch.library.register_fake("kernels::flash_attn_bwd")
def _(do, q, k, v, o, lse, causal, scale, key_band, row_band, backend, softcap=0.0, alibi=False, sinks=None,
      prefix=0):
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return empty_bhtd(B, H, T, D, q), empty_bhtd(B, H_kv, S, D, k), empty_bhtd(B, H_kv, S, D, v), dsinks


def _op_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, key_band, row_band, backend, softcap, alibi, sinks, prefix = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, key_band, row_band, sinks)
    ctx.causal, ctx.scale, ctx.backend, ctx.softcap, ctx.alibi = causal, scale, backend, softcap, alibi
    ctx.prefix = prefix


def _op_backward(ctx, do, dlse):  # dlse: LSE is an output for the backward only, never differentiated
    q, k, v, o, lse, key_band, row_band, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.kernels.flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, key_band,
                                                          row_band, ctx.backend, ctx.softcap, ctx.alibi, sinks,
                                                          ctx.prefix)
    return dq, dk, dv, None, None, None, None, None, None, None, None if sinks is None else dsinks, None


torch.library.register_autograd("kernels::flash_attn_fwd", _op_backward, setup_context=_op_setup_context)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd wrapper: the launchers without the custom-op dispatch (see above)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, bounds, backend, mods, sinks, prefix):
        o, lse = _forward(q, k, v, causal, scale, bounds, backend, mods, sinks, prefix)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.causal, ctx.scale, ctx.bounds, ctx.backend, ctx.mods = causal, scale, bounds, backend, mods
        ctx.prefix = prefix
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv, *dsinks = _backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.bounds, ctx.backend,
                                        ctx.mods, sinks, ctx.prefix)
        return dq, dk, dv, None, None, None, None, None, *(dsinks or [None]), None


def flash_attention(q, k, v, causal=True, softmax_scale=None, doc_ids=None, window=0, backend="auto", mods=None,
                    sinks=None, prefix=0):
    """softmax(softmax_scale * q k^T, mask) v for q (B, H, T, D) and k, v (B, H_kv, S, D).

    Returns (B, H, T, D) in q's dtype; softmax_scale defaults to 1 / sqrt(D). doc_ids (B, T) of
    packed documents (a document is a run of equal ids; causal, T == S): query i then attends key j
    only within its own document, and the tiles of other documents are skipped. window W > 0
    (causal): query i sees only the W keys up to its own (a sliding window; with documents, within
    its document too), and the tiles outside the window are skipped. prefix P > 0 (causal): a
    prefix-LM, every query sees its document's (or the sequence's) first P keys too, later ones
    included, still within its window (only the portable kernels take one).
    mods: a kernels.score_mods.ScoreMods (None, or one with nothing on: none), applied to the scaled
    scores s = softmax_scale * q.k before the mask: softcap C > 0 makes them C tanh(s / C), then
    alibi adds -slope_h |j - i'| (i' = i + S - T; alibi_slopes(H), per query head). sinks: None or
    a (H,) float tensor, one logit per query head in units of s, in every row's softmax
    denominator: a row may give part of its weight to no key (one that sees no key returns 0).
    Autograd returns its gradient, in its dtype.
    backend: "auto" (by length, the faster kernels here), "triton" (the portable kernels) or "gluon"
    (the Hopper kernels, which take sinks but no mods or prefix; a ValueError where they cannot run). Under
    torch.autocast, q, k and v are first cast to the autocast dtype, as autocast does for
    scaled_dot_product_attention.
    """
    backends.check_backend(backend)
    q, k, v = autocast_inputs(q, k, v)
    bounds = checked_bounds(q, k, v, causal, doc_ids, window, prefix)
    mods = checked_mods(q, mods, sinks)
    scale = softmax_scale_of(q, softmax_scale)
    # the custom op where something watches the dispatcher: torch.compile, and modes such as
    # selective activation checkpointing, which must see the attention as one op to keep it
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return torch.ops.kernels.flash_attn_fwd(q, k, v, bool(causal), scale, *(bounds or (None, None)), backend,
                                                float(mods.softcap), mods.alibi, sinks, prefix)[0]
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale, bounds, backend, mods, sinks, prefix)
