"""Attention kernels; they know nothing about the model that calls them."""

from kernels.api import flash_attention, flash_attn_backward, flash_attn_forward
from kernels.backends import LAUNCHERS, unsupported
from kernels.flops import attention_flops
from kernels.inputs import MAX_HEAD_DIM

__all__ = ["LAUNCHERS", "MAX_HEAD_DIM", "attention_flops", "flash_attention", "flash_attn_backward",
           "flash_attn_forward", "unsupported"]
