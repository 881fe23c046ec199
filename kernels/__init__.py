"""Attention kernels; they know nothing about the model that calls them."""

from kernels.flash_attn import MAX_HEAD_DIM, flash_attention, flash_attn_backward, flash_attn_forward, unsupported
from kernels.flops import attention_flops

__all__ = ["MAX_HEAD_DIM", "attention_flops", "flash_attention", "flash_attn_backward", "flash_attn_forward",
           "unsupported"]
