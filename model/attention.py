"""The attention swap point: one signature, and one registry of the implementations and what each can do.

Every implementation takes q (B, H, T, D), k and v (B, H_kv, T, D) with H_kv dividing H (grouped
key/value heads: query head h reads kv head h // (H / H_kv)), and optionally doc_ids (B, T) of packed
documents, and returns causal attention shaped like q, in its dtype, within each document when
doc_ids is given. The model calls the `fn` of the Attention it is given and never asks which one
it is. What an attention can do (head dims, splitting a sequence over ranks, what selective
activation checkpointing keeps of it) is written in its entry, once: the config's choices and
checks, the trainer, the benchmark and the equivalence check read it from here. A new attention
is a function and an entry below.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import MAX_HEAD_DIM, flash_attention, unsupported

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, doc_ids=None) -> (B, H, T, D)


def hidden_keys(doc_ids: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """(B or 1, 1, T, T) bool: True where query i may not see key j (the future, another document)."""
    future = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)[None, None]
    if doc_ids is None:
        return future
    return future | (doc_ids[:, None, :, None] != doc_ids[:, None, None, :])


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Textbook attention: materialises the (B, H, T, T) scores in the input dtype. Fewer key/value
    heads (GQA) are repeated, each for its group of query heads."""
    if k.size(1) != q.size(1):  # query head h reads kv head h // (H / H_kv)
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    scores = scores.masked_fill(hidden_keys(doc_ids, q.size(-2), q.device), float("-inf"))
    # softmax in (at least) fp32: bf16 exp/sum would lose the many small probabilities
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return probs @ v  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """PyTorch's fused attention; which backend runs is torch's choice unless pinned (configs/runtime.py).
    With documents it gets a dense (B, 1, T, T) mask, which its flash and cuDNN kernels do not take."""
    gqa = k.size(1) != q.size(1)
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden_keys(doc_ids, q.size(-2), q.device),
                                          enable_gqa=gqa)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Our FlashAttention-2 Triton kernels (kernels/flash_attn.py); with documents, block-sparse."""
    return flash_attention(q, k, v, causal=True, doc_ids=doc_ids)


@dataclass(frozen=True)
class Attention:
    name: str  # attn=<name>
    fn: AttentionFn
    about: str  # what runs, in a line
    max_head_dim: int | None = None  # None: any
    # why (head_dim, dtype, device) cannot run, or None; None: anything runs
    unsupported: Callable[[int, torch.dtype, torch.device], str | None] | None = None
    context_parallel: bool = False  # one sequence over several ranks: ring attention over its kernels
    # the ops selective activation checkpointing keeps (output and LSE); none: recomputed whole
    saved_ops: tuple = ()


ATTENTIONS = {a.name: a for a in (
    Attention("naive", naive_attention, "textbook softmax attention, the (T x T) scores in memory"),
    Attention("sdpa", sdpa_attention, "torch.nn.functional.scaled_dot_product_attention (backend logged on CUDA)",
              saved_ops=(torch.ops.aten._scaled_dot_product_flash_attention.default,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                         torch.ops.aten._scaled_dot_product_efficient_attention.default,
                         torch.ops.aten._scaled_dot_product_cudnn_attention.default)),
    Attention("triton", triton_attention, "our FlashAttention-2 forward and backward Triton kernels",
              max_head_dim=MAX_HEAD_DIM, unsupported=unsupported, context_parallel=True,
              saved_ops=(torch.ops.kernels.flash_attn_fwd.default,)),
)}


def get_attention(name: str) -> Attention:
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}: choose one of {sorted(ATTENTIONS)} (attn=NAME)")
    return ATTENTIONS[name]
