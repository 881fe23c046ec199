"""What a GPU can run, as it reports it: compute capability and shared memory per block."""

import functools
from typing import NamedTuple

# bf16 needs compute capability 8.0 (Ampere): tl.dot on bf16 does not compile below it, and torch
# only emulates bf16 there (torch.cuda.is_bf16_supported() counts that). configs/runtime.py's
# dtype=auto reads it too.
BF16_MIN_CAPABILITY = (8, 0)


class Chip(NamedTuple):
    """What a config must fit, as the GPU reports it."""
    name: str
    capability: tuple[int, int]  # (major, minor): 8.0 Ampere, 8.9 Ada, 9.0 Hopper
    smem_bytes: int  # shared memory one block may opt into (227 KB on an H100, 99 KB on an RTX 4090)
    nvidia: bool = True
    sms: int = 132  # streaming multiprocessors: how many programs a persistent kernel launches

    @property
    def bf16(self) -> bool:
        return self.capability >= BF16_MIN_CAPABILITY

    @property
    def tma(self) -> bool:
        """TMA descriptors (and wgmma) exist from Hopper (sm_90) on."""
        return self.nvidia and self.capability >= (9, 0)


@functools.cache
def chip(device_index: int) -> Chip:
    """The Chip of CUDA device `device_index` (read once per process)."""
    import torch

    from kernels.runtime.internals import max_shared_memory

    props = torch.cuda.get_device_properties(device_index)
    smem = max_shared_memory(device_index)  # the opt-in maximum
    return Chip(props.name, (props.major, props.minor), smem, nvidia=torch.version.hip is None,
                sms=props.multi_processor_count)


H100 = Chip("NVIDIA H100 80GB HBM3", (9, 0), 227 * 1024)  # what the tile tables were tuned on


class NoConfigFits(ValueError):
    """No candidate fits this GPU at this head dim and input width."""
