"""What a config's device and dtype mean on this machine: one answer for train.py and every script."""

import re
from contextlib import AbstractContextManager, nullcontext

import torch


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> torch.device; ValueError naming what this machine has."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError("choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError("this machine has no CUDA GPU (torch.cuda.is_available() is False): use device=cpu")
    if device != "cuda" and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(device)


def uses_bf16(dtype: str, device: torch.device) -> bool:
    """The autocast policy: bf16 when asked for, or by default (dtype=auto) on CUDA; else fp32."""
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """The context that forward passes run under (a fresh one each call: it is single-use)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(dtype, device) else nullcontext()
