"""The order of work of the Hopper kernels, FlashAttention-3's tile scheduler: which tile a
persistent program takes next and what that tile's work is. One program per SM takes tile after
tile from a counter zeroed for the launch (hand_out_tile, by the producer warp, which passes each
tile to the program's other partitions through a 2-slot ring: take_tile). The forward numbers its
tiles in L2-sized sections of (batch, head) pairs, each section's longest query blocks first
(fwd_tile; the section's size: config.fwd_section); the backward numbers key blocks shortest or
longest first (bwd_tile; config.bwd_section), and walks each tile's query blocks
(bwd_step_rows) in the order its dQ writer adds their shares."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from kernels.hopper.blocks import kv_blocks, q_blocks
from kernels.hopper.pipeline import MaybeTensor, Scalar, scalar
from kernels.runtime.internals import aggregate

# --------------------------------------------------------------------------------------------
# the forward


@aggregate
class FwdWork:
    """The launch's work: tiles of a query block (CONSUMERS * FWD_ROWS rows) of one head and batch
    row, numbered in launch order (fwd_tile: SECTION); COUNTER (int32, zeroed for the launch):
    the tiles handed out past the first num_programs; KEY_LO (Bounds.key_lo, or None); the sizes
    and the scale."""
    COUNTER: gl.tensor
    KEY_LO: MaybeTensor
    H: Scalar
    B: Scalar
    GROUP: Scalar
    T: Scalar
    S: Scalar
    qk_scale: gl.tensor
    SECTION: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, COUNTER, KEY_LO, H, B, GROUP, T, S, qk_scale, SECTION):
        self.COUNTER, self.KEY_LO, self.qk_scale = COUNTER, scalar(KEY_LO), qk_scale
        self.SECTION = gl.constexpr(SECTION)
        self.H, self.B, self.GROUP, self.T, self.S = scalar(H), scalar(B), scalar(GROUP), scalar(T), scalar(S)


@aggregate
class FwdProgram:
    """The work of one tile: batch, head, kv head, first query row, key blocks lo .. n_blocks - 1;
    the batch row's key_lo; the sizes and the scale."""
    off_b: Scalar
    off_h: Scalar
    off_hkv: Scalar
    start_m: Scalar
    lo: Scalar
    n_blocks: Scalar
    KEY_LO: gl.tensor
    H: Scalar
    T: Scalar
    S: Scalar
    qk_scale: gl.tensor

    @gluon.constexpr_function
    def __init__(self, off_b, off_h, off_hkv, start_m, lo, n_blocks, KEY_LO, H, T, S, qk_scale):
        self.off_b, self.off_h, self.off_hkv, self.start_m = map(scalar, (off_b, off_h, off_hkv, start_m))
        self.lo, self.n_blocks, self.KEY_LO = scalar(lo), scalar(n_blocks), KEY_LO
        self.H, self.T, self.S, self.qk_scale = scalar(H), scalar(T), scalar(S), qk_scale


@gluon.jit
def in_sections(tile, per_pair, pairs, SECTION: gl.constexpr):
    """(pair, i) of tile number `tile` of per_pair tiles for each of `pairs` pairs, numbered in
    sections of SECTION pairs: a section's tile 0 of each of its pairs in turn, then their tile 1,
    and so on."""
    section = tile // (SECTION * per_pair)
    first = section * SECTION
    in_section = gl.minimum(pairs - first, SECTION)  # the last section may have fewer
    rank = tile - section * (SECTION * per_pair)
    return first + rank % in_section, rank // in_section


@gluon.jit
def fwd_tile(tile, n_m, H, B, SECTION: gl.constexpr, BLOCK_M: gl.constexpr):
    """(start_m, off_h, off_b) of tile number `tile` of n_m * H * B in launch order: in sections of
    SECTION (batch, head) pairs, each section's query blocks longest first, its heads in turn within
    a block row: tiles running together share K and V that fit L2."""
    head, i = in_sections(tile, n_m, H * B, SECTION)
    return (n_m - 1 - i) * BLOCK_M, head % H, head // H


@gluon.jit
def fwd_first_tile(work, BLOCK_M: gl.constexpr):
    """(the program's first tile, n_m query blocks a head, the launch's n_tiles): the first tiles go
    out at launch, a program each, the rest from COUNTER."""
    n_m = gl.cdiv(work.T, BLOCK_M)
    return gl.program_id(0), n_m, n_m * work.H * work.B


@gluon.jit
def fwd_program(tile, n_m, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """The FwdProgram of one tile: its rows, head, batch row and key blocks."""
    start_m, off_h, off_b = fwd_tile(tile, n_m, work.H, work.B, work.SECTION, BLOCK_M)
    lo, n_blocks, key_lo = kv_blocks(work.KEY_LO, off_b, start_m, work.T, work.S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
    return FwdProgram(off_b, off_h, off_h // work.GROUP, start_m, lo, n_blocks, key_lo, work.H, work.T, work.S,
                      work.qk_scale)


# --------------------------------------------------------------------------------------------
# the backward


@aggregate
class BwdWork:
    """The launch's work: tiles of one key block (BLOCK_N keys) of one kv head and batch row,
    numbered in launch order (bwd_tile: LONGEST_FIRST, 0 or a section's pairs); COUNTER (int32, zeroed for the
    launch; the kernel's COUNTS[0]): the tiles handed out, every one of them; KEY_LO and ROW_HI
    (Bounds', or None); the sizes."""
    COUNTER: gl.tensor
    KEY_LO: MaybeTensor
    ROW_HI: MaybeTensor
    H: Scalar
    B: Scalar
    GROUP: Scalar
    T: Scalar
    S: Scalar
    LONGEST_FIRST: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, COUNTER, KEY_LO, ROW_HI, H, B, GROUP, T, S, LONGEST_FIRST):
        self.COUNTER, self.KEY_LO, self.ROW_HI = COUNTER, scalar(KEY_LO), scalar(ROW_HI)
        self.H, self.B, self.GROUP, self.T, self.S = scalar(H), scalar(B), scalar(GROUP), scalar(T), scalar(S)
        self.LONGEST_FIRST = gl.constexpr(LONGEST_FIRST)


@aggregate
class BwdProgram:
    """Which work the program owns: batch, kv head, key block n of n_blocks, and `steps` Q blocks
    from m_lo for each of the GROUP query heads of the kv head, walked up from m_lo or (LONGEST_FIRST)
    down to it; the sizes."""
    off_b: Scalar
    off_hkv: Scalar
    n: Scalar
    n_blocks: Scalar
    m_lo: Scalar
    steps: Scalar
    H: Scalar
    GROUP: Scalar
    T: Scalar
    S: Scalar
    LONGEST_FIRST: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, off_b, off_hkv, n, n_blocks, m_lo, steps, H, GROUP, T, S, LONGEST_FIRST):
        self.off_b, self.off_hkv, self.n, self.n_blocks = scalar(off_b), scalar(off_hkv), scalar(n), scalar(n_blocks)
        self.m_lo, self.steps, self.H, self.GROUP = scalar(m_lo), scalar(steps), scalar(H), scalar(GROUP)
        self.T, self.S, self.LONGEST_FIRST = scalar(T), scalar(S), gl.constexpr(LONGEST_FIRST)


@gluon.jit
def bwd_tile(tile, n_blocks, H_kv, B, LONGEST_FIRST: gl.constexpr):
    """(off_b, off_hkv, n) of tile number `tile` of n_blocks * H_kv * B in launch order: shortest
    first, each (batch, kv head) pair's key blocks last first, pair after pair; longest first, in
    sections of LONGEST_FIRST pairs, key block 0 (causal: the longest) of each of a section's pairs,
    then block 1, and so on."""
    if LONGEST_FIRST:
        pair, n = in_sections(tile, n_blocks, H_kv * B, LONGEST_FIRST)
        return pair // H_kv, pair % H_kv, n
    pair = tile // n_blocks
    return pair // H_kv, pair % H_kv, n_blocks - 1 - (tile - pair * n_blocks)


@gluon.jit
def bwd_tiles(work, BLOCK_N: gl.constexpr):
    """(n_blocks key blocks a kv head, the launch's n_tiles)."""
    n_blocks = gl.cdiv(work.S, BLOCK_N)
    return n_blocks, n_blocks * (work.H // work.GROUP) * work.B


@gluon.jit
def bwd_program(tile, n_blocks, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """(BwdProgram, row_hi, full_hi, key_lo) of one tile: its key block, the Q blocks that see it
    (q_blocks), the batch row's bounds."""
    off_b, off_hkv, n = bwd_tile(tile, n_blocks, work.H // work.GROUP, work.B, work.LONGEST_FIRST)
    m_lo, m_hi, row_hi, full_hi = q_blocks(work.ROW_HI, off_b, n, work.T, work.S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
    program = BwdProgram(off_b, off_hkv, n, n_blocks, m_lo, m_hi - m_lo, work.H, work.GROUP, work.T, work.S,
                         work.LONGEST_FIRST)
    key_lo = 0  # unbounded: unread
    if BOUNDED:
        key_lo = work.KEY_LO + off_b.to(gl.int64) * work.T
    return program, row_hi, full_hi, key_lo


@gluon.jit
def bwd_step_rows(j, program, BLOCK_M: gl.constexpr):
    """Step j's query head and first row: the group's heads in turn, each over Q blocks m_lo.. up;
    longest first, Q blocks from the last down to m_lo, the group's heads in turn on each (under a
    plain causal mask every program of a kv head then meets a Q block at the same step, in launch
    order: dQ's)."""
    GROUP = program.GROUP
    if program.LONGEST_FIRST:
        i = j // GROUP
        g = j - i * GROUP
        start_m = (program.m_lo + program.steps - 1 - i) * BLOCK_M
    else:
        g = j // program.steps
        start_m = (program.m_lo + j - g * program.steps) * BLOCK_M
    return program.off_hkv * GROUP + g, start_m


# --------------------------------------------------------------------------------------------
# the persistent programs' hand-out


@gluon.jit
def hand_out_tile(i, first, work, buffers):
    """The i-th tile the producer takes from the counter: the next of the launch order not yet
    taken (tile `first` is the counter's 0), for the program's other partitions too through slot
    i % 2 of the buffers' tile ring; past the last tile when none is left."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    taken = gl.atomic_add(work.COUNTER + lane * 0, lane * 0 + 1, mask=lane == 0)
    tile = first + gl.max(gl.where(lane == 0, taken, 0), 0)
    mbarrier.wait(buffers.tile_empty.index(i % 2), ((i // 2) & 1) ^ 1)  # a fresh barrier passes phase 1
    buffers.tile_smem.index(i % 2).store(gl.full([32], tile, gl.int32, lane.type.layout))
    gl.thread_barrier()  # every lane's store before the arrive
    mbarrier.arrive(buffers.tile_ready.index(i % 2), count=1)
    return tile


@gluon.jit
def take_tile(i, buffers, NUM_WARPS: gl.constexpr):
    """The i-th tile the producer handed out (hand_out_tile), read by a consumer."""
    mbarrier.wait(buffers.tile_ready.index(i % 2), (i // 2) & 1)
    tile = gl.max(buffers.tile_smem.index(i % 2).load(gl.BlockedLayout([1], [32], [NUM_WARPS], [0])), 0)
    gl.thread_barrier()  # every thread has read the slot before it is freed
    mbarrier.arrive(buffers.tile_empty.index(i % 2), count=1)
    return tile
