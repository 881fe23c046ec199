"""The Hopper kernels' table (sm_90, Gluon): where they run, their tiles and register budgets.

Every number was measured best on the H100 (docs/perf-notes.md v10-v13, v16-v17). Adding a head dim is a
row in FWD_TILES and BWD_TILES; kernels/backends.py reads the rest to say where they run.
Plain Python, importable with any triton: Gluon's API is imported only by the kernels' files.
The schedule variants are switched per call by environment variables read here (unset: the
faster, as measured), so that one process can time both.
"""

import os
from typing import NamedTuple

import torch

TRITON = "3.6."  # the triton release whose Gluon the kernels are written in
CAPABILITY = (9, 0)  # sm_90: H100, H200 (wgmma, TMA, warp specialization)
DTYPES = (torch.float16, torch.bfloat16)
# unset FLASH_ATTENTION_BACKEND: from MIN_SEQ queries on, the forward runs here wherever it can,
# and the backward at the head dims where it is the faster (the Triton backward at 64); below
# MIN_SEQ, where host time per call decides, the portable kernels
MIN_SEQ = 2048
BACKWARD_HEAD_DIMS = (128,)


class FwdTiles(NamedTuple):
    consumers: int  # consumer warpgroups of FWD_ROWS query rows each
    block_n: int  # keys per ring slot
    stages: int  # depth of the K/V ring


class BwdTiles(NamedTuple):
    block_m: int  # query rows per step
    block_n: int  # keys per program
    stages: int  # depth of the Q/dO ring


FWD_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
# head dim -> forward tiles below and from FWD_LONG queries: at D = 64 a third consumer pays once
# rows are many enough that its 64 extra masked rows per program do not (v11)
FWD_LONG = 2048
FWD_TILES = {64: (FwdTiles(2, 128, 3), FwdTiles(3, 128, 3)),
             128: (FwdTiles(2, 128, 3), FwdTiles(2, 128, 3))}
BWD_TILES = {64: BwdTiles(64, 128, 3), 128: BwdTiles(64, 128, 2)}
HEAD_DIMS = tuple(FWD_TILES)
BWD_WARPS = 8  # the backward's matmul warps: two warpgroups, one wgmma M of BLOCK_N keys

# Registers are shared out per warpgroup, 64K in all. The 1-warp workers (the forward's producer;
# the backward's producer and dQ writer, together in one warpgroup) only issue TMA copies, wait
# on barriers and add: WORKER_REGS each.
REGISTERS = 65536
WORKER_REGS = 24


# the deepest K/V ring that fits an sm_90 block's 232,448 B of shared memory beside Q's tiles
FWD_MAX_STAGES = {64: 4, 128: 3}


def fwd_tiles(head_dim: int, seq_len: int) -> FwdTiles:
    """The forward's tiles; FLASH_ATTENTION_FWD_STAGES sets the K/V ring's depth instead of the
    table's (2 up to FWD_MAX_STAGES)."""
    tiles = FWD_TILES[head_dim][seq_len >= FWD_LONG]
    stages = _variant(FWD_STAGES_VARIABLE, ("2", "3", "4"))
    if stages and int(stages) > FWD_MAX_STAGES[head_dim]:
        raise ValueError(f"{FWD_STAGES_VARIABLE}={stages}: at head dim {head_dim} the ring holds at most "
                         f"{FWD_MAX_STAGES[head_dim]} slots in shared memory")
    return tiles._replace(stages=int(stages)) if stages else tiles


def fwd_registers(consumers: int) -> tuple[int, int]:
    """(maxnreg, consumer registers) of the forward: the producer's warp takes a warpgroup slot at
    WORKER_REGS; the consumers split the rest, the default partition (consumer 0) getting what
    maxnreg leaves it."""
    maxnreg = REGISTERS // ((consumers + 1) * 128) // 8 * 8
    return maxnreg, (REGISTERS // 128 - WORKER_REGS) // consumers // 8 * 8


def bwd_maxnreg() -> int:
    """The backward's matmul warps get what is left of 64K over 3 warpgroups (240 each)."""
    return REGISTERS // ((BWD_WARPS + 4) * 32) // 8 * 8


# --------------------------------------------------------------------------------------------
# schedule variants, read per call

FWD_ORDER_VARIABLE = "FLASH_ATTENTION_FWD_ORDER"  # heads: the forward's programs head by head (unset: l2)
BWD_STEP_VARIABLE = "FLASH_ATTENTION_BWD_STEP"  # overlap: the next step's S^T, dP^T issued before this one's waits
FWD_OVERLAP_VARIABLE = "FLASH_ATTENTION_FWD_OVERLAP"  # 1 / 0: block j-1's P V during block j's softmax, or not
FWD_STAGES_VARIABLE = "FLASH_ATTENTION_FWD_STAGES"  # the forward's K/V ring depth (unset: FWD_TILES')
L2_BYTES = 50 * 1024 * 1024  # the H100's L2: a section's K and V stay in it while its programs run


def _variant(variable: str, allowed: tuple[str, ...]) -> str:
    choice = os.environ.get(variable, "")
    if choice not in ("", *allowed):
        raise ValueError(f"{variable}={choice}: use {' or '.join(allowed)} (or leave it unset)")
    return choice


def fwd_section(heads: int, group: int, seq_k: int, head_dim: int, itemsize: int) -> int:
    """FLASH_ATTENTION_FWD_ORDER: l2 (unset), the (batch, head) pairs of all `heads` in sections of
    this many whose K and V fit L2_BYTES together (the query heads of one kv head share theirs), each
    section's query blocks longest first across its heads: 4-10% faster forward from T = 4096 on
    the H100 (perf-notes v16); heads, 0: the programs launch head by head, longest first in each."""
    if _variant(FWD_ORDER_VARIABLE, ("l2", "heads")) == "heads":
        return 0
    kv_heads = max(1, L2_BYTES // (2 * seq_k * head_dim * itemsize))
    return min(kv_heads * group, heads)


# the head dims where FLASH_ATTENTION_BWD_STEP=overlap applies: at 128 the next step's S^T and
# dP^T in flight beside dK, dV and dQ would need 224 of the 240 accumulator registers, and ptxas
# serializes every wgmma for want of registers (with S^T alone too)
BWD_OVERLAP_HEAD_DIMS = (64,)


def bwd_overlap(head_dim: int) -> bool:
    """FLASH_ATTENTION_BWD_STEP: unset, a step waits for its own dV, dK and dQ before the next
    step's S^T = K Q^T and dP^T = V dO^T are issued; overlap, they are issued before that wait
    (at BWD_OVERLAP_HEAD_DIMS)."""
    return _variant(BWD_STEP_VARIABLE, ("overlap",)) == "overlap" and head_dim in BWD_OVERLAP_HEAD_DIMS


# the head dims where the forward overlaps P V with the next block's softmax unless
# FLASH_ATTENTION_FWD_OVERLAP=0: 1.06-1.09x the forward at D = 128 from T = 4096 with a 3-slot ring
# (perf-notes v17); at 64, 0.95-1.04x
FWD_OVERLAP_HEAD_DIMS = (128,)


def fwd_overlap(head_dim: int) -> bool:
    """FLASH_ATTENTION_FWD_OVERLAP: 0, a consumer issues block j's P V after its softmax and waits
    for it; 1, it issues block j's S then block j-1's P V, waits for S alone, and runs the softmax
    while P V is on the tensor cores (a slot is freed one block later); unset, 1 at
    FWD_OVERLAP_HEAD_DIMS."""
    choice = _variant(FWD_OVERLAP_VARIABLE, ("0", "1"))
    return choice == "1" if choice else head_dim in FWD_OVERLAP_HEAD_DIMS
