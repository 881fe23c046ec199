"""The attention swap point: one signature, a name -> function map, nothing else.

Every implementation takes q, k, v of shape (B, H, T, D) and returns causal attention of the same
shape and dtype. The GPT model calls `get_attention(name)` once and never branches on the name.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook attention: materialises the (B, H, T, T) scores in the input dtype."""
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    # softmax in (at least) fp32: bf16 exp/sum would lose the many small probabilities
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return probs @ v  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused attention; which backend runs is torch's choice unless pinned by the caller."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Our FlashAttention-2 Triton kernels (kernels/flash_attn.py)."""
    # imported on first use: the kernel module chooses Triton's CPU interpreter at import time
    from kernels import flash_attention

    return flash_attention(q, k, v, causal=True)


ATTENTIONS: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "triton": triton_attention,
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


def get_sdpa_backend(name: str) -> SDPBackend:
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r}: choose one of {sorted(SDPA_BACKENDS)} or null")
    return SDPA_BACKENDS[name]


def sdpa_backend_in_use(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Name of the SDPA backend torch dispatches to for these inputs under the active sdpa_kernel."""
    # torch's own dispatcher choice (private API: there is no public one); same rules as the real call
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True))
    return choice.name.lower()
