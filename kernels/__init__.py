"""Attention kernels; they know nothing about the model that calls them."""

from kernels.flash_attn import flash_attention

__all__ = ["flash_attention"]
