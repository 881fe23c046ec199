"""The FLOP convention for attention, defined once: the FlashAttention papers' and Triton's tutorial's."""


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool = True) -> float:
    """Forward matmul FLOPs of attention: QK^T and PV, 2 * 2 * T * S * D per (batch, head),
    halved for a causal mask. Kernel benchmarks count the backward as 2.5x this (it recomputes
    QK^T); model FLOPs for MFU count it as 2x (work the model needs, not the kernel's choice)."""
    return 4 * batch * heads * seq_q * seq_k * head_dim / (2 if causal else 1)
