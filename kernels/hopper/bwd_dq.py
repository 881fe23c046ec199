"""The Hopper backward's dQ, the same bits every run: the matmul warps hand each step's share dS K
to a writer warp through two shared-memory buffers (hand_dq), and the writer adds the shares of
each Q block into an fp32 accumulator by TMA reduce-add in a fixed order, key block after key
block (write_dq). A share waits for its turn (blocks.dq_turn) on a per-Q-block counter of the
writer lanes that have released theirs; the order follows the tiles' launch order, so a share
waits only on tiles already taken by programs that run. bwd_passes.py scales the accumulator
back into dQ after the kernel."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kernels.hopper.blocks import dq_turn
from kernels.hopper.pipeline import bulk_done, load_acquire
from kernels.hopper.schedule import bwd_program, bwd_step_rows, bwd_tiles, take_tile
from kernels.runtime.internals import reinterpret, tma_add

# --------------------------------------------------------------------------------------------
# the matmul warps' side


@gluon.jit
def hand_dq(j, dq, dq_smem, dq_full, dq_empty):
    """Step j's dQ share (BLOCK_M, D) into the writer's buffer j % 2, once the writer has added
    what that buffer last held."""
    BLOCK_M: gl.constexpr = dq.type.shape[0]
    HEAD_DIM: gl.constexpr = dq.type.shape[1]
    buf = j % 2
    mbarrier.wait(dq_empty.index(buf), ((j // 2) & 1) ^ 1)
    # in 8-column slabs (D / 8, BLOCK_M, 8), unswizzled: a wgmma accumulator's thread holds two
    # adjacent floats of a row and its quad the row's 8, so a half-warp's 64-bit stores fill 4 rows
    # of a slab, 128 contiguous bytes, one wavefront (row by row under the 128-byte swizzle they
    # took two); the reshape and permute move no data
    slabs = reinterpret(dq_smem.index(buf), gl.float32, [HEAD_DIM // 8, BLOCK_M, 8],
                        gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    slabs.store(gl.permute(gl.reshape(dq, [BLOCK_M, HEAD_DIM // 8, 8]), [1, 0, 2]))
    fence_async_shared()  # the writer's TMA reads what these threads wrote
    gl.thread_barrier()  # every warp's part is written
    mbarrier.arrive(dq_full.index(buf), count=1)


# --------------------------------------------------------------------------------------------
# the writer warp


@gluon.jit
def write_dq(io, buffers, work, ORDER, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """The dQ writer warp: the dQ shares of each tile it is handed (_write_tile). ORDER: (B, H,
    cdiv(T, BLOCK_M)) int32, zeroed: how many writer lanes have released a share, per Q block."""
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[0]
    n_blocks, n_tiles = bwd_tiles(work, BLOCK_N)
    t = gl.program_id(0) * 0
    base = t  # as the producer counts it
    tile = take_tile(t, buffers, 1)
    while tile < n_tiles:
        program, _, _, key_lo = bwd_program(tile, n_blocks, work, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
        _write_tile(io, buffers, program, ORDER, key_lo, base, CAUSAL, BOUNDED)
        base += program.steps * program.GROUP
        t += 1
        tile = take_tile(t, buffers, 1)


@gluon.jit
def _write_tile(io, buffers, program, ORDER, KEY_LO, base, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """Adds each step's dQ share into the fp32 accumulator by one TMA reduce-add, in key-block
    order (blocks.dq_turn), the same every run; step j's share is in buffer (base + j) % 2."""
    dq_smem, dq_full, dq_empty = buffers.dq_smem, buffers.dq_full, buffers.dq_empty
    off_b, n, steps = program.off_b, program.n, program.steps
    H, GROUP, T, S = program.H, program.GROUP, program.T, program.S
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[0]
    LINES: gl.constexpr = dq_smem.type.shape[1]
    # one lane per thread of the warp: each polls the counter and releases the share it added
    lane_zero = gl.zeros([32], gl.int32, gl.BlockedLayout([1], [32], [1], [0]))
    m_blocks = gl.cdiv(T, BLOCK_M)
    for j in range(steps * GROUP):
        off_h, start_m = bwd_step_rows(j, program, BLOCK_M)
        counter = ORDER + (off_b * H + off_h) * m_blocks + start_m // BLOCK_M + lane_zero
        landed = load_acquire(counter)  # read now, its latency hidden behind the wait below
        # every lane of every program whose turn comes first has released its share
        turn = dq_turn(KEY_LO, start_m, n, program.n_blocks, T, S, CAUSAL, BOUNDED, program.LONGEST_FIRST, BLOCK_M,
                       BLOCK_N) * 32
        r = base + j
        buf = r % 2
        mbarrier.wait(dq_full.index(buf), (r // 2) & 1)
        while gl.min(landed, 0) < turn:
            landed = load_acquire(counter)
        # the Q block's BLOCK_M x D floats are LINES lines of the accumulator, as in shared memory
        tma_add(io.dqacc_desc, [((off_b * H + off_h) * m_blocks + start_m // BLOCK_M) * LINES, 0], dq_smem.index(buf))
        bulk_done(lane_zero)  # the add has landed in global memory, and its shared reads are done
        mbarrier.arrive(dq_empty.index(buf), count=1)
        gl.atomic_add(counter, lane_zero + 1, sem="release")
