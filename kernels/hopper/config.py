"""The Hopper kernels' table (sm_90, Gluon): where they run, their tiles and register budgets.

Every number was measured best on the H100 (docs/perf-notes.md v10-v13, v16-v21, v28-v29). Adding a head dim is a
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
# unset FLASH_ATTENTION_BACKEND: from MIN_SEQ queries on, both directions run here wherever they
# can; below MIN_SEQ, where host time per call decides, the portable kernels
MIN_SEQ = 2048


class FwdTiles(NamedTuple):
    consumers: int  # consumer warpgroups of FWD_ROWS query rows each
    block_n: int  # keys per ring slot
    stages: int  # depth of the K/V ring


class BwdTiles(NamedTuple):
    block_m: int  # query rows per step
    block_n: int  # keys per program
    stages: int  # depth of the Q/dO ring
    by_rows: bool = False  # S = Q K^T by query rows, P and dS through shared memory; else S^T =
    # K Q^T by keys, P^T and dS^T kept in registers as dV's and dK's A operands (a step of 128 rows
    # takes them in two column halves)


FWD_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
# head dim -> forward tiles below and from FWD_LONG queries: at D = 64 a third consumer pays once
# rows are many enough that its 64 extra masked rows per program do not (v11)
FWD_LONG = 2048
FWD_TILES = {64: (FwdTiles(2, 128, 3), FwdTiles(3, 128, 3)),
             128: (FwdTiles(2, 128, 3), FwdTiles(2, 128, 3))}
# by keys, FlashAttention-3's tiles: at D = 64 a step of 128 rows taken in two column halves,
# 1.01-1.04x by rows with the same bits (perf-notes v28, v29); at D = 128 a step of 64
BWD_TILES = {64: BwdTiles(128, 128, 2), 128: BwdTiles(64, 128, 2)}
# FLASH_ATTENTION_BWD_BY_KEYS=0: by rows at D = 64 (1.04-1.14x the 64-row tiles by keys of v18); at
# 128, 128-row tiles by rows would not fit shared memory
BWD_BY_ROWS = {64: BwdTiles(128, 128, 2, by_rows=True)}
HEAD_DIMS = tuple(FWD_TILES)
BWD_WARPS = 8  # the backward's matmul warps: two warpgroups
# head dim -> from how many keys a plain causal backward launches its longest programs first (v19:
# at D = 128 from 8,192 keys 1.03-1.08x in 10 of 12 measurements, 0.94 and 0.99 in the others; at
# D = 64, whose programs take half as many steps, 0.96-1.05x by rows)
BWD_LONGEST_FIRST_FROM = {128: 8192}

# Registers are shared out per warpgroup, 64K in all. The backward's 1-warp workers (its producer
# and dQ writer, together in one warpgroup) only issue TMA copies, wait on barriers and add:
# WORKER_REGS each.
REGISTERS = 65536
WORKER_REGS = 24
# the forward's producer also walks the tiles a persistent program takes: at 24 registers it
# spilled one (D = 128). At 32 the consumer partitions keep what they had at 24 (240 or 160, in
# steps of 8), and consumer 0, the kernel's own warps, has 8 fewer (232 or 160); none spills
FWD_PRODUCER_REGS = 32


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


def bwd_tiles(head_dim: int) -> BwdTiles:
    """The backward's tiles: BWD_TILES', or with FLASH_ATTENTION_BWD_BY_KEYS=0 BWD_BY_ROWS', refused
    at a head dim that has no tiles by rows."""
    if _variant(BWD_BY_KEYS_VARIABLE, ("0", "1")) != "0":
        return BWD_TILES[head_dim]
    if head_dim not in BWD_BY_ROWS:
        raise ValueError(f"{BWD_BY_KEYS_VARIABLE}=0: at head dim {head_dim} the backward is held by keys only: "
                         "use 1 or leave it unset")
    return BWD_BY_ROWS[head_dim]


def bwd_longest_first(head_dim: int, causal: bool, bounded: bool, seq_k: int) -> bool:
    """The backward's order. Shortest first: the programs of a kv head launch last key block first,
    each walks its Q blocks up from the diagonal, and dQ's shares are added last key block first.
    Longest first: key block 0 of every (batch, kv head) pair, then block 1, ...; each walks its Q
    blocks down from the last, and dQ's shares are added first key block first. Under a plain
    causal mask, from BWD_LONGEST_FIRST_FROM keys, longest first does not end on a tail of the
    longest programs. With fewer keys, or documents, the programs are short, and their lock-step
    start waits on dQ's order (0.79-1.00x); with no mask or a window they are alike.
    FLASH_ATTENTION_BWD_ORDER=shortest|longest chooses."""
    choice = _variant(BWD_ORDER_VARIABLE, ("shortest", "longest"))
    if choice:
        return choice == "longest"
    return causal and not bounded and head_dim in BWD_LONGEST_FIRST_FROM and BWD_LONGEST_FIRST_FROM[head_dim] <= seq_k


def fwd_registers(consumers: int) -> tuple[int, int]:
    """(maxnreg, consumer registers) of the forward: the producer's warp takes a warpgroup slot at
    FWD_PRODUCER_REGS; the consumers split the rest, the default partition (consumer 0) getting what
    maxnreg leaves it."""
    maxnreg = REGISTERS // ((consumers + 1) * 128) // 8 * 8
    return maxnreg, (REGISTERS // 128 - FWD_PRODUCER_REGS) // consumers // 8 * 8


def bwd_maxnreg() -> int:
    """The backward's matmul warps get what is left of 64K over 3 warpgroups (240 each)."""
    return REGISTERS // ((BWD_WARPS + 4) * 32) // 8 * 8


# --------------------------------------------------------------------------------------------
# schedule variants, read per call

FWD_ORDER_VARIABLE = "FLASH_ATTENTION_FWD_ORDER"  # heads: the forward's tiles head by head (unset: l2)
FWD_OVERLAP_VARIABLE = "FLASH_ATTENTION_FWD_OVERLAP"  # 1 / 0: block j-1's P V during block j's softmax, or not
FWD_STAGES_VARIABLE = "FLASH_ATTENTION_FWD_STAGES"  # the forward's K/V ring depth (unset: FWD_TILES')
BWD_BY_KEYS_VARIABLE = "FLASH_ATTENTION_BWD_BY_KEYS"  # 0 at D = 64: the backward by rows (unset: by keys)
BWD_ORDER_VARIABLE = "FLASH_ATTENTION_BWD_ORDER"  # shortest / longest: which backward programs launch first
FWD_PERSISTENT_VARIABLE = "FLASH_ATTENTION_FWD_PERSISTENT"  # 1 / 0: one forward program per SM taking tiles, or not
BWD_PERSISTENT_VARIABLE = "FLASH_ATTENTION_BWD_PERSISTENT"  # 1 / 0: the same for the backward
FWD_TURNS_VARIABLE = "FLASH_ATTENTION_FWD_TURNS"  # 1 / 0: the forward's consumers issue matmuls in turn, or not
FWD_EXP2_FMA_VARIABLE = "FLASH_ATTENTION_FWD_EXP2_FMA"  # 1 / 0: a share of the forward's exp2s on the FMA pipe, or not
VARIABLES = (FWD_ORDER_VARIABLE, FWD_OVERLAP_VARIABLE, FWD_STAGES_VARIABLE, BWD_BY_KEYS_VARIABLE, BWD_ORDER_VARIABLE,
             FWD_PERSISTENT_VARIABLE, BWD_PERSISTENT_VARIABLE, FWD_TURNS_VARIABLE, FWD_EXP2_FMA_VARIABLE)
L2_BYTES = 50 * 1024 * 1024  # the H100's L2: a section's K and V stay in it while its programs run


def _variant(variable: str, allowed: tuple[str, ...]) -> str:
    choice = os.environ.get(variable, "")
    if choice not in ("", *allowed):
        raise ValueError(f"{variable}={choice}: use {' or '.join(allowed)} (or leave it unset)")
    return choice


def _switch(variable: str, default: bool) -> bool:
    """An on/off variant: 1 or 0, or `default` where the variable is unset."""
    choice = _variant(variable, ("0", "1"))
    return choice == "1" if choice else default


def fwd_section(heads: int, group: int, seq_k: int, head_dim: int, itemsize: int) -> int:
    """FLASH_ATTENTION_FWD_ORDER: l2 (unset), the (batch, head) pairs of all `heads` in sections of
    this many whose K and V fit L2_BYTES together (the query heads of one kv head share theirs), each
    section's query blocks longest first across its heads: 4-10% faster forward from T = 4096 on
    the H100 (perf-notes v16); heads, 0: the tiles go head by head, longest first in each."""
    if _variant(FWD_ORDER_VARIABLE, ("l2", "heads")) == "heads":
        return 0
    kv_heads = max(1, L2_BYTES // (2 * seq_k * head_dim * itemsize))
    return min(kv_heads * group, heads)


# the head dims where the forward overlaps P V with the next block's softmax unless
# FLASH_ATTENTION_FWD_OVERLAP=0: 1.06-1.09x the forward at D = 128 from T = 4096 with a 3-slot ring
# (perf-notes v17); at 64, 0.95-1.04x
FWD_OVERLAP_HEAD_DIMS = (128,)


# whether the forward is persistent unless FLASH_ATTENTION_FWD_PERSISTENT says
FWD_PERSISTENT = True


def fwd_persistent() -> bool:
    """FLASH_ATTENTION_FWD_PERSISTENT: 1, one forward program per SM; its producer takes the next
    tile of the launch order from a counter in global memory once it has issued the current one's
    loads, so that a tile's first K/V loads run during the last one's softmax and epilogue; 0, a
    program per tile; unset, FWD_PERSISTENT."""
    return _switch(FWD_PERSISTENT_VARIABLE, FWD_PERSISTENT)


# whether the backward is persistent unless FLASH_ATTENTION_BWD_PERSISTENT says: 1.00-1.05x forward
# and backward, 1-5% on documents and windows (v22). Every tile goes out from the counter, the first
# ones too, so a tile goes only to a program that runs, and a share of dQ's fixed order waits only
# on tiles that running programs hold, while another kernel holds SMs too (DDP's all-reduce).
BWD_PERSISTENT = True


def bwd_persistent() -> bool:
    """FLASH_ATTENTION_BWD_PERSISTENT: 1, one backward program per SM, taking tile after tile (a key
    block each) of the launch order from a counter, so that the next tile's first Q and dO tiles
    load during this one's last steps; 0, a program per key block; unset, BWD_PERSISTENT. dQ's
    fixed order of adds follows the launch order either way."""
    return _switch(BWD_PERSISTENT_VARIABLE, BWD_PERSISTENT)


def fwd_overlap(head_dim: int) -> bool:
    """FLASH_ATTENTION_FWD_OVERLAP: 0, a consumer issues block j's P V after its softmax and waits
    for it; 1, it issues block j's S then block j-1's P V, waits for S alone, and runs the softmax
    while P V is on the tensor cores (a slot is freed one block later); unset, 1 at
    FWD_OVERLAP_HEAD_DIMS."""
    return _switch(FWD_OVERLAP_VARIABLE, head_dim in FWD_OVERLAP_HEAD_DIMS)


# the head dims where the forward's consumers take turns on the tensor cores unless
# FLASH_ATTENTION_FWD_TURNS=0: none. In turn the forward read 0.996-1.016x at D = 64 and 0.92-1.01x at
# D = 128, its tensor pipes as busy as without (perf-notes v26)
FWD_TURNS_HEAD_DIMS = ()


def fwd_turns(head_dim: int) -> bool:
    """FLASH_ATTENTION_FWD_TURNS: 1, each forward consumer issues a ring slot's matmuls (S, and with
    the overlap the previous block's P V) once the one before it has issued its own, round the
    consumers (kernels/hopper/pipeline.py: Turns); 0, each issues as soon as its operands are ready;
    unset, 1 at FWD_TURNS_HEAD_DIMS."""
    return _switch(FWD_TURNS_VARIABLE, head_dim in FWD_TURNS_HEAD_DIMS)


# the head dims where the forward computes a share of its exponentials on the FMA pipe unless
# FLASH_ATTENTION_FWD_EXP2_FMA=0: none. With one score in FWD_EXP2_FMA_EVERY moved there the forward read
# 0.96-0.98x at D = 64 from T = 4096 (0.94x with documents) and 0.98x at D = 128 (perf-notes v31)
FWD_EXP2_FMA_HEAD_DIMS = ()
FWD_EXP2_FMA_EVERY = 8


def fwd_exp2_fma(head_dim: int) -> bool:
    """FLASH_ATTENTION_FWD_EXP2_FMA: 1, in the forward's mask-free blocks one score in
    FWD_EXP2_FMA_EVERY takes its exponential as a cubic on the FMA pipe (kernels/hopper/fwd.py:
    _exp2), off the exp2 unit; 0, every one on the exp2 unit; unset, 1 at FWD_EXP2_FMA_HEAD_DIMS."""
    return _switch(FWD_EXP2_FMA_VARIABLE, head_dim in FWD_EXP2_FMA_HEAD_DIMS)
