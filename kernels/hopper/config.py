"""The Hopper kernels' table (sm_90, Gluon): where they run, and one row per head dim of their
tiles and schedule, as FlashAttention-3 keeps its tile_size_fwd_sm90.

Each choice in a row was measured the best on the H100 (docs/perf-notes.md gives the number and the
command); adding a head dim is one row of TABLE. kernels/backends.py reads the rest to say where the
kernels run. Plain Python, importable with any triton: Gluon's API is imported only by the kernels'
files.
"""

from typing import NamedTuple

import torch

TRITON = "3.6."  # the triton release whose Gluon the kernels are written in
CAPABILITY = (9, 0)  # sm_90: H100, H200 (wgmma, TMA, warp specialization)
DTYPES = (torch.float16, torch.bfloat16)
# backend="auto": from MIN_SEQ queries on, both directions run here wherever they can; below it,
# where host time per call decides, the portable kernels
MIN_SEQ = 2048


class FwdTiles(NamedTuple):
    consumers: int  # consumer warpgroups of FWD_ROWS query rows each
    block_n: int  # keys per ring slot
    stages: int  # depth of the K/V ring


class BwdTiles(NamedTuple):
    block_m: int  # query rows per step (by keys: S^T = K Q^T, P^T and dS^T kept in registers)
    block_n: int  # keys per program
    stages: int  # depth of the Q/dO ring


class Row(NamedTuple):
    """One head dim's kernels."""
    fwd: FwdTiles  # the forward's tiles below FWD_LONG queries
    fwd_long: FwdTiles  # and from FWD_LONG on
    fwd_overlap: bool  # block j - 1's P V issued behind block j's S, the softmax run while it runs
    bwd: BwdTiles  # the backward's tiles
    bwd_section: int  # a plain causal backward goes longest first in sections of this many pairs; 0: shortest


# D = 64: a third consumer from FWD_LONG queries on, where its 64 extra masked rows per program no
# longer cost more than it gains; no overlap (it does not pay there); the backward's step of 128
# rows in two column halves (FlashAttention-3's), shortest first. D = 128: the overlap with a
# 3-slot ring, longest first in sections of 8 (batch, kv head) pairs under a plain causal mask.
# docs/perf-notes.md gives each choice its number.
TABLE = {64: Row(FwdTiles(2, 128, 3), FwdTiles(3, 128, 3), False, BwdTiles(128, 128, 2), 0),
         128: Row(FwdTiles(2, 128, 3), FwdTiles(2, 128, 3), True, BwdTiles(64, 128, 2), 8)}
HEAD_DIMS = tuple(TABLE)
FWD_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
FWD_LONG = 2048
BWD_WARPS = 8  # the backward's matmul warps: two warpgroups

# Registers are shared out per warpgroup, 64K in all. The backward's 1-warp workers (its producer
# and dQ writer, together in one warpgroup) only issue TMA copies, wait on barriers and add:
# WORKER_REGS each.
REGISTERS = 65536
WORKER_REGS = 24
# the forward's producer also walks the tiles a persistent program takes: at 24 registers it
# spilled one (D = 128). At 32 the consumer partitions keep what they had at 24 (240 or 160, in
# steps of 8), and consumer 0, the kernel's own warps, has 8 fewer (232 or 160); none spills
FWD_PRODUCER_REGS = 32
L2_BYTES = 50 * 1024 * 1024  # the H100's L2: a section's K and V stay in it while its programs run


def fwd_tiles(head_dim: int, seq_len: int) -> FwdTiles:
    row = TABLE[head_dim]
    return row.fwd_long if seq_len >= FWD_LONG else row.fwd


def bwd_section(head_dim: int, causal: bool, bounded: bool) -> int:
    """The backward's order: 0, shortest first, or longest first in sections of this many (batch, kv
    head) pairs. Shortest first: the programs of a kv head launch last key block first, each walks
    its Q blocks up from the diagonal, and dQ's shares are added last key block first. Longest
    first: key block 0 of each of a section's pairs, then their block 1, ...; each program walks its
    Q blocks down from the last, and dQ's shares are added first key block first. Under a plain
    causal mask at D = 128 the launch then ends on the last section's shortest programs, not on a
    tail of the longest; sections of 8 pairs measured faster than shortest first and than all
    pairs at once below 8,192 keys, and level from there (docs/perf-notes.md). With documents
    the programs are short, and their lock-step start waits on dQ's order; with no mask or a window
    they are alike."""
    return TABLE[head_dim].bwd_section if causal and not bounded else 0


def fwd_registers(consumers: int) -> tuple[int, int]:
    """(maxnreg, consumer registers) of the forward: the producer's warp takes a warpgroup slot at
    FWD_PRODUCER_REGS; the consumers split the rest, the default partition (consumer 0) getting what
    maxnreg leaves it."""
    maxnreg = REGISTERS // ((consumers + 1) * 128) // 8 * 8
    return maxnreg, (REGISTERS // 128 - FWD_PRODUCER_REGS) // consumers // 8 * 8


def bwd_maxnreg() -> int:
    """The backward's matmul warps get what is left of 64K over 3 warpgroups (240 each)."""
    return REGISTERS // ((BWD_WARPS + 4) * 32) // 8 * 8


def fwd_section(heads: int, group: int, seq_k: int, head_dim: int, itemsize: int) -> int:
    """The forward's launch order: the (batch, head) pairs of all `heads` in sections of this many,
    whose K and V fit L2_BYTES together (the query heads of one kv head share theirs), each
    section's query blocks longest first across its heads: tiles running together share K and V
    that L2 holds (docs/perf-notes.md measures it against head by head)."""
    kv_heads = max(1, L2_BYTES // (2 * seq_k * head_dim * itemsize))
    return min(kv_heads * group, heads)
