"""The FLOP convention for attention, defined once: the FlashAttention papers' and Triton's tutorial's."""


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool = True,
                    window: int = 0) -> float:
    """Forward matmul FLOPs of attention: QK^T and PV, 2 * 2 * T * S * D per (batch, head),
    halved for a causal mask; a causal window of W < S keys leaves T * W - W^2 / 2 of the T * S
    pairs (T^2 / 2 at W = T = S). Kernel benchmarks count the backward as 2.5x this (it
    recomputes QK^T); model FLOPs for MFU count it as 2x (work the model needs, not the kernel's
    choice)."""
    if causal and 0 < window < seq_k:
        return 4 * batch * heads * head_dim * (seq_q * window - window * window / 2)
    return 4 * batch * heads * seq_q * seq_k * head_dim / (2 if causal else 1)
