"""Block-size candidates for the attention kernels, and the pruning that keeps those that fit.

Each list is in order of preference, from scripts/tune_attention.py on an H100 (causal bf16, D 64
and 128; docs/perf-notes.md has the tables): autotuning benchmarks the candidates that fit, and
with FLASH_ATTENTION_AUTOTUNE=0 the first that fits runs. The small tiles at the end are what
fits at D = 256. On the CPU one small fixed config runs: blocks small enough that test shapes
span several of them, and BLOCK_M != BLOCK_N both ways round to exercise the block arithmetic.
"""

import triton

# Per-program budgets, calibrated against Triton 3.6's sm_90 compiles (shared memory as
# allocated; ptxas register and spill reports) for D in {64, 80, 128, 256}: H100 allows 227 KB
# of shared memory per block, and every config above 192 live fp32 values per thread spilled.
SMEM_BYTES = 226 * 1024
FP32_PER_THREAD = 192


def _configs(resident: str, streamed: str, *candidates) -> list[triton.Config]:
    """triton.Configs from (resident rows, streamed rows, num_warps, num_stages) tuples."""
    return [triton.Config({resident: r, streamed: s}, num_warps=w, num_stages=n) for r, s, w, n in candidates]


def pruner(resident: str, streamed: str, resident_tiles: int, acc_tiles: int, score_tiles: int):
    """prune(configs, constexprs, itemsize): the configs whose tiles fit in shared memory and
    registers at the head-dim tile constexprs["BLOCK_D"] (or the smallest one, if none does).

    Per program: resident_tiles (rows, D) input tiles stay in shared memory (Q; Q and dO; K and
    V), two streamed (rows, D) tiles are buffered per pipeline stage; acc_tiles (rows, D) fp32
    accumulators and score_tiles (resident rows, streamed rows) fp32 tiles live in registers.
    """

    def prune(configs: list[triton.Config], constexprs: dict, itemsize: int) -> list[triton.Config]:
        block_d = constexprs["BLOCK_D"]

        def area(c):
            return c.kwargs[resident] * c.kwargs[streamed]

        def smem(c):
            return (resident_tiles * c.kwargs[resident] + 2 * c.num_stages * c.kwargs[streamed]) * block_d * itemsize

        def fp32_per_thread(c):
            return (acc_tiles * c.kwargs[resident] * block_d + score_tiles * area(c)) / (32 * c.num_warps)

        kept = [c for c in configs if smem(c) <= SMEM_BYTES and fp32_per_thread(c) <= FP32_PER_THREAD]
        return kept or [min(configs, key=lambda c: (area(c), -c.num_warps))]

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

CPU_FWD = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})
CPU_DQ = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})
CPU_DKDV = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})
