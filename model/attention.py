"""The attention swap point: one signature, a name -> function map, nothing else.

Every implementation takes q, k, v of shape (B, H, T, D), and optionally doc_ids (B, T) of packed
documents, and returns causal attention of the same shape and dtype, within each document when
doc_ids is given. The GPT model calls `get_attention(name)` once and never branches on the name.
"""

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from configs.schema import AttnName
from kernels import flash_attention

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, doc_ids=None) -> (B, H, T, D)


def hidden_keys(doc_ids: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """(B or 1, 1, T, T) bool: True where query i may not see key j (the future, another document)."""
    future = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)[None, None]
    if doc_ids is None:
        return future
    return future | (doc_ids[:, None, :, None] != doc_ids[:, None, None, :])


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Textbook attention: materialises the (B, H, T, T) scores in the input dtype."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    scores = scores.masked_fill(hidden_keys(doc_ids, q.size(-2), q.device), float("-inf"))
    # softmax in (at least) fp32: bf16 exp/sum would lose the many small probabilities
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return probs @ v  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """PyTorch's fused attention; which backend runs is torch's choice unless pinned (sdpa_backend).
    With documents it gets a dense (B, 1, T, T) mask, which its flash and cuDNN kernels do not take."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden_keys(doc_ids, q.size(-2), q.device))


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Our FlashAttention-2 Triton kernels (kernels/flash_attn.py); with documents, block-sparse."""
    return flash_attention(q, k, v, causal=True, doc_ids=doc_ids)


ATTENTIONS: dict[str, AttentionFn] = {  # one entry per configs.schema.AttnName
    AttnName.naive.value: naive_attention,
    AttnName.sdpa.value: sdpa_attention,
    AttnName.triton.value: triton_attention,
}

# the ops that compute attention as one call: what selective activation checkpointing keeps
# (naive attention has none; it is recomputed whole)
ATTENTION_OPS = {
    torch.ops.kernels.flash_attn_fwd.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def get_attention(name: str) -> AttentionFn:
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}: choose one of {sorted(ATTENTIONS)} (attn=NAME)")
    return ATTENTIONS[name]


def sdpa_backend(name: str | None) -> AbstractContextManager:
    """A fresh context pinning SDPA to backend `name` (nullcontext for None): the contexts are single-use."""
    return nullcontext() if name is None else sdpa_kernel(SDPA_BACKENDS[name])


def sdpa_backend_in_use(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None = None,
                        masked: bool = False) -> str:
    """The SDPA backend (a key of SDPA_BACKENDS) torch dispatches these inputs to, pinned to
    `backend` if given, as sdpa_attention calls it (masked: with the dense document mask);
    RuntimeError if that backend cannot run them."""
    B, _, T, _ = q.shape
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device).expand(B, 1, T, T) if masked else None
    with sdpa_backend(backend):
        # torch's own dispatcher choice (private API: there is no public one); same rules as the real call
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, not masked))
    return next(name for name, b in SDPA_BACKENDS.items() if b == choice)


def probe_sdpa_backend(seq_len: int, n_head: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       backend: str | None = None, masked: bool = False) -> str:
    """sdpa_backend_in_use for the model's own inputs: strided views of one (B, T, 3, H, D) projection,
    for one sequence (torch's choice does not depend on the batch, which need not fit in memory here)."""
    qkv = torch.empty(1, seq_len, 3, n_head, head_dim, device=device, dtype=dtype)
    return sdpa_backend_in_use(*qkv.permute(2, 0, 3, 1, 4), backend=backend, masked=masked)
