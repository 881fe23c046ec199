"""The portable kernels' table: tile candidates, pruned to what a GPU fits.

Each list is in order of preference, from scripts/tune_attention.py on an H100 (causal bf16, D 64
and 128; docs/perf-notes.md has the tables): autotuning benchmarks the candidates that fit the
running GPU, and with FLASH_ATTENTION_AUTOTUNE=0 the first of them that compiles and launches
runs. The small tiles at the end are what fits at D = 256 or on a card with less shared memory.
On the CPU one small fixed config runs: blocks small enough that test shapes span several of
them, and BLOCK_M != BLOCK_N both ways round to exercise the block arithmetic.
"""

import torch
import triton
import triton.language as tl

from kernels.runtime.chips import Chip, NoConfigFits

# Registers: every NVIDIA GPU from Volta on gives a thread at most 255 32-bit registers, and on
# sm_90 Triton's compiles of every config above 192 live fp32 values per thread spilled.
FP32_PER_THREAD = 192
# Shared memory: the estimate below counts the tiles; Triton's barriers and layout conversions
# take up to ~1 KB more (calibrated on sm_90 compiles for D in {64, 80, 128, 256})
SMEM_RESERVED = 1024


def _configs(resident: str, streamed: str, *candidates) -> list[triton.Config]:
    """triton.Configs from (resident rows, streamed rows, num_warps, num_stages) tuples."""
    return [triton.Config({resident: r, streamed: s}, num_warps=w, num_stages=n) for r, s, w, n in candidates]


def pruner(resident: str, streamed: str, resident_tiles: int, acc_tiles: int, score_tiles: int):
    """prune(configs, constexprs, itemsize, chip): the configs whose tiles fit in the chip's shared
    memory and in registers at the head-dim tile of constexprs["HEAD_DIM"]; NoConfigFits if none does.

    Per program: resident_tiles (rows, D) input tiles stay in shared memory (Q; Q and dO; K and
    V), two streamed (rows, D) tiles are buffered per pipeline stage; acc_tiles (rows, D) fp32
    accumulators and score_tiles (resident rows, streamed rows) fp32 tiles live in registers.
    """

    def prune(configs: list[triton.Config], constexprs: dict, itemsize: int, chip: Chip) -> list[triton.Config]:
        tile_d = block_d(constexprs["HEAD_DIM"])

        def area(c):
            return c.kwargs[resident] * c.kwargs[streamed]

        def smem(c):
            return (resident_tiles * c.kwargs[resident] + 2 * c.num_stages * c.kwargs[streamed]) * tile_d * itemsize

        def fp32_per_thread(c):
            return (acc_tiles * c.kwargs[resident] * tile_d + score_tiles * area(c)) / (32 * c.num_warps)

        budget = chip.smem_bytes - SMEM_RESERVED
        kept = [c for c in configs if smem(c) <= budget and fp32_per_thread(c) <= FP32_PER_THREAD]
        if not kept:
            need = min(smem(c) for c in configs)
            raise NoConfigFits(f"flash_attention: no tile size fits head_dim {constexprs['HEAD_DIM']} ({8 * itemsize}-"
                               f"bit) in the {chip.smem_bytes // 1024} KB of shared memory per block of {chip.name}: "
                               f"the smallest needs {-(-need // 1024)} KB; use a smaller head_dim or another attention")
        return kept

    return prune


FWD = _configs("BLOCK_M", "BLOCK_N",
               (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3),
               (64, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2))
DQ = _configs("BLOCK_M", "BLOCK_N",
              (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3),
              (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2))
DKDV = _configs("BLOCK_N", "BLOCK_M",
                (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                (64, 16, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2))
# (resident tiles, fp32 accumulator tiles, fp32 score tiles) per kernel
FWD_PRUNE = pruner("BLOCK_M", "BLOCK_N", 1, 1, 1)
DQ_PRUNE = pruner("BLOCK_M", "BLOCK_N", 2, 1, 2)
DKDV_PRUNE = pruner("BLOCK_N", "BLOCK_M", 2, 2, 2)
PREPROCESS = triton.Config({"BLOCK_M": 64})  # LSE * log2(e) and delta = rowsum(dO * O): one config everywhere

CPU_FWD = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})
CPU_DQ = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})
CPU_DKDV = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})


@triton.constexpr_function
def dot_precision(dtype) -> str:
    """tl.dot's input precision for inputs of this dtype (inside a kernel): fp32 as true fp32
    ("ieee"), as in training; fp16 and bf16 multiply at their own precision whatever it is named."""
    return "ieee" if dtype == tl.float32 else "tf32"


@triton.constexpr_function
def block_d(head_dim: int) -> int:
    """The head-dim tile: D padded to a power of two >= 16 (on the host, and inside a kernel)."""
    return max(16, triton.next_power_of_2(head_dim))


def tuning_key_and_constexprs(q: torch.Tensor, k: torch.Tensor, causal: bool, bounded: bool, tma: bool,
                              softcap: float = 0.0):
    """(tuning key, constexprs) of a launch: a new sequence length retunes only past a power of two.
    A softcap is compiled in (SOFTCAP, 0.0: none) but tunes as the plain scores do."""
    D, T, S = q.shape[3], q.shape[2], k.shape[2]
    key = (q.device.index, q.dtype, block_d(D), causal, bounded, tma, triton.next_power_of_2(T),
           triton.next_power_of_2(S))
    constexprs = {"HEAD_DIM": D, "CAUSAL": causal, "TMA": tma, "SOFTCAP": float(softcap)}
    return key, constexprs
