"""The attention swap point: one signature, and one registry of the implementations and what each can do.

Every implementation takes q (B, H, T, D), k and v (B, H_kv, T, D) with H_kv dividing H (grouped
key/value heads: query head h reads kv head h // (H / H_kv)), and optionally doc_ids (B, T) of packed
documents and a window W, and returns causal attention shaped like q, in its dtype, within each
document when doc_ids is given, over each query's last W keys (its own included) when W > 0. The
model calls the `fn` of the Attention it is given and never asks which one it is. What an attention
can do (head dims, splitting a sequence over ranks, what selective activation checkpointing keeps
of it, how it decodes against a KV cache) is written in its entry, once: the config's choices and
checks, the trainer, the benchmark and the equivalence check read it from here. A new attention
is a function and an entry below. How each decodes against the cache: model/kv_cache.py.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import MAX_HEAD_DIM, flash_attention, unsupported
from kernels.masking import Mask
from model.kv_cache import DecodeFn, dense_decode, triton_decode
from model.peers import fa4_attention, fa4_unsupported, flex_attention, flex_unsupported

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, doc_ids=None, window=0) -> (B, H, T, D)


@dataclass(frozen=True)
class Attention:
    name: str  # attn=<name>
    fn: AttentionFn
    about: str  # what runs, in a line
    # generation against a KV cache (model/kv_cache.py)
    decode: DecodeFn
    # graphable: decode reads no host copy of the cache's length, so a decode step may be captured
    # in a CUDA graph
    graphable: bool = False
    max_head_dim: int | None = None  # None: any
    # why (head_dim, dtype, device) cannot run, or None; None: anything runs
    unsupported: Callable[[int, torch.dtype, torch.device], str | None] | None = None
    # how one sequence splits over ranks (parallel.cp > 1): "ring", ours over its kernels
    # (kernels/ring_attention.py); "torch", torch's context_parallel (its ring over SDPA's CUDA
    # kernels, trainer/parallel.py); None: it cannot
    context_parallel: str | None = None
    # the ops selective activation checkpointing keeps (output and LSE); none: recomputed whole
    saved_ops: tuple = ()
    # which of our kernels run it (kernels/backends.py: auto, triton, gluon); None: it has no such choice
    backend: str | None = None


# -----------------------------------------------------------------------------
# the implementations


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                    window: int = 0) -> torch.Tensor:
    """Textbook attention: materialises the (B, H, T, S) scores in the input dtype (S = T in training;
    the cache's length in decoding). Fewer key/value heads (GQA) are repeated, each for its group of
    query heads."""
    if k.size(1) != q.size(1):  # query head h reads kv head h // (H / H_kv)
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, S)
    seen = Mask(q.size(-2), k.size(-2), True, doc_ids, window).dense(q.device)  # (B or 1, 1, T, S)
    scores = scores.masked_fill(~seen, float("-inf"))
    # softmax in (at least) fp32: bf16 exp/sum would lose the many small probabilities
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return probs @ v  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                   window: int = 0) -> torch.Tensor:
    """PyTorch's fused attention; which backend runs is torch's choice unless pinned (configs/runtime.py).
    Where sdpa_masked says so it gets a dense (B or 1, 1, T, S) mask."""
    gqa = k.size(1) != q.size(1)
    T, S = q.size(-2), k.size(-2)
    if not sdpa_masked(doc_ids is not None, window, T, S):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=Mask(T, S, True, doc_ids, window).dense(q.device),
                                          enable_gqa=gqa)


def sdpa_masked(documents: bool, window: int, T: int, S: int) -> bool:
    """Whether sdpa_attention passes SDPA a dense mask (which its flash and cuDNN kernels do not take):
    with documents, a window shorter than the keys, or fewer queries than keys (SDPA's is_causal is
    aligned top-left, the newest queries' bottom-right)."""
    return documents or 0 < window < S or T != S


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                     window: int = 0, backend: str = "auto") -> torch.Tensor:
    """Our FlashAttention kernels (kernels/triton/, and kernels/hopper/ on sm_90: backend chooses);
    with documents or a window, block-sparse."""
    return flash_attention(q, k, v, causal=True, doc_ids=doc_ids, window=window, backend=backend)


# -----------------------------------------------------------------------------
# the registry


ATTENTIONS = {a.name: a for a in (
    Attention("naive", naive_attention, "textbook softmax attention, the (T x T) scores in memory",
              decode=functools.partial(dense_decode, attend=naive_attention)),
    Attention("sdpa", sdpa_attention, "torch.nn.functional.scaled_dot_product_attention (backend logged on CUDA)",
              decode=functools.partial(dense_decode, attend=sdpa_attention), context_parallel="torch",
              saved_ops=(torch.ops.aten._scaled_dot_product_flash_attention.default,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                         torch.ops.aten._scaled_dot_product_efficient_attention.default,
                         torch.ops.aten._scaled_dot_product_cudnn_attention.default)),
    Attention("triton", triton_attention, "our FlashAttention-2 forward and backward Triton kernels",
              max_head_dim=MAX_HEAD_DIM, unsupported=unsupported, context_parallel="ring",
              saved_ops=(torch.ops.kernels.flash_attn_fwd.default,), decode=triton_decode, graphable=True,
              backend="auto"),
    # the peers ours is measured against (model/peers.py); flex decodes through SDPA, where a
    # BlockMask and a compile per cache length would cost more than the step
    Attention("flex", flex_attention, "torch.nn.attention.flex_attention, compiled, with BlockMasks (CUDA to train)",
              decode=functools.partial(dense_decode, attend=sdpa_attention), unsupported=flex_unsupported),
    Attention("fa4", fa4_attention, "FlashAttention-4 (flash_attn.cute), optional: pip install flash-attn-4",
              decode=functools.partial(dense_decode, attend=fa4_attention), max_head_dim=256,
              unsupported=fa4_unsupported),
)}


def get_attention(name: str, backend: str = "auto") -> Attention:
    """The registry's entry of attn=name, its kernels' backend chosen where it has a choice (attn.backend)."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}: choose one of {sorted(ATTENTIONS)} (attn=NAME)")
    entry = ATTENTIONS[name]
    if backend == entry.backend or (backend == "auto" and entry.backend is None):
        return entry
    if entry.backend is None:
        raise ValueError(f"attn.backend={backend}: chooses which of our kernels attn=triton runs; attn={name} "
                         "has no such choice (attn.sdpa_backend pins SDPA's)")
    return dataclasses.replace(entry, fn=functools.partial(entry.fn, backend=backend), backend=backend)
