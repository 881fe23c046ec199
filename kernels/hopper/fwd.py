"""The FlashAttention forward for Hopper (sm_90) in Gluon, warp-specialized: O and LSE of q
(B, H, T, D) against k, v (B, H_kv, S, D), as kernels/triton/fwd.py computes them.

A tile is CONSUMERS * FWD_ROWS query rows of one head. One warp (the producer) streams the tile's
K/V blocks by TMA into a STAGES-deep ring; each consumer warpgroup owns FWD_ROWS of the rows, runs
the online softmax over every block (S = Q K_j^T by wgmma, P straight from registers as the A
operand of P V_j) and frees the slot when its matmuls are done. While one consumer waits on its
matmuls the other's exp2s run: the overlap FlashAttention-3 gets from its second warpgroup,
without its hand-written schedule. Where the head dim's row says so (config.Row.fwd_overlap) it
adds the overlap FlashAttention-3 gets within a warpgroup: each block's P V is issued behind the
next block's S and runs during that block's softmax. Q arrives by TMA once a tile; O leaves by TMA
through Q's buffer. The program is persistent: one per SM, it takes tile after tile in launch
order (L2-sized sections, config.fwd_section) from a counter zeroed for the launch, and the ring
runs on from one tile into the next, so that the next tile's first loads overlap this one's last
blocks and its epilogue.
Tiles, stages and registers: kernels/hopper/config.py. docs/flash-attention.md derives it.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.hopper import config
from kernels.hopper.blocks import descriptor, kv_runs
from kernels.hopper.pipeline import FwdBuffers, FwdIO, skip_slot
from kernels.hopper.schedule import FwdWork, fwd_first_tile, fwd_program, hand_out_tile, take_tile
from kernels.hopper.softmax import online_softmax, p_operand, rescale
from kernels.runtime import chips
from kernels.runtime.launch import PREPARED, launch_and_bind, on_device
from kernels.triton.blocks import LOG2E

PRODUCER_REGS = gl.constexpr(config.FWD_PRODUCER_REGS)  # the producer issues TMA copies, waits and hands out tiles

# --------------------------------------------------------------------------------------------
# the partitions


@gluon.jit
def _scores(i, q_t, buffers, ASYNC: gl.constexpr):
    """S = Q K^T (ROWS, BLOCK_N) of ring slot i once its K has landed: its result, or (ASYNC) in flight."""
    k_smem, k_ready = buffers.k_smem, buffers.k_ready
    ROWS: gl.constexpr = q_t.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    stage = i % STAGES
    mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
    return warpgroup_mma(q_t, k_smem.index(stage).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                         use_acc=False, is_async=ASYNC)


@gluon.jit
def _fwd_step(i, j, acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo, MASKED: gl.constexpr,
              CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """Key block j (ring slot i) of the online softmax; frees the slot when its matmuls are done."""
    STAGES: gl.constexpr = buffers.k_smem.type.shape[0]
    stage = i % STAGES
    phase = (i // STAGES) & 1
    qk = _scores(i, q_t, buffers, True)
    qk = warpgroup_mma_wait(0, deps=[qk])
    p, alpha, l_i, m_new = online_softmax(qk, j, m_i, l_i, rows, cols, key_lo, program, MASKED, CAUSAL, BOUNDED)
    acc = rescale(acc, alpha)
    # -- O += P V, then the slot is free --
    mbarrier.wait(buffers.v_ready.index(stage), phase)
    acc = warpgroup_mma(p_operand(p, acc, q_t.dtype), buffers.v_smem.index(stage), acc)
    mbarrier.arrive(buffers.kv_empty.index(stage), count=1)
    return acc, l_i, m_new


@gluon.jit
def _fwd_step_overlap(i, j, acc, p_prev, l_i, m_i, q_t, buffers, program, rows, cols, key_lo, MASKED: gl.constexpr,
                      CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """Key block j (ring slot i) while block j - 1's P V (p_prev, slot i - 1, its V landed) runs
    on the tensor cores: S of block j and that P V are issued one after the other, the softmax
    waits for S alone, and slot i - 1 is freed once its P V is done. Returns block j's P for the
    next step."""
    STAGES: gl.constexpr = buffers.k_smem.type.shape[0]
    prev = (i - 1) % STAGES
    qk = _scores(i, q_t, buffers, True)
    acc = warpgroup_mma(p_prev, buffers.v_smem.index(prev), acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=[qk])  # wgmma groups complete in order: S, then P V
    p, alpha, l_i, m_new = online_softmax(qk, j, m_i, l_i, rows, cols, key_lo, program, MASKED, CAUSAL, BOUNDED)
    # block j's V, for the next step's P V; its wait loop also ends ptxas's scheduling region
    # here, which would otherwise hoist the wait below above the softmax and run both in turn
    mbarrier.wait(buffers.v_ready.index(i % STAGES), (i // STAGES) & 1)
    acc, _ = warpgroup_mma_wait(0, deps=[acc, p_prev])  # p_prev: read by that P V until here
    mbarrier.arrive(buffers.kv_empty.index(prev), count=1)
    return rescale(acc, alpha), p_operand(p, acc, q_t.dtype), l_i, m_new


@gluon.jit
def _fwd_blocks_overlap(acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo, origin, own_lo, full_lo, n_full,
                        CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """The consumer's key blocks own_lo .. n_blocks - 1 with each P V one block late
    (config.Row.fwd_overlap): the first block's S and softmax alone, then the steps, then the last
    block's P V; key block j is ring slot j - origin. Every wait drains the wgmma queue before a
    loop's back edge."""
    STAGES: gl.constexpr = buffers.k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[1]
    ROWS: gl.constexpr = q_t.type.shape[0]
    n_blocks = program.n_blocks
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    p = gl.zeros([ROWS, BLOCK_N], q_t.dtype, p_layout)
    if own_lo < n_blocks:  # masked: the first block may need it (visible is exact on a mask-free one)
        i = own_lo - origin
        qk = _scores(i, q_t, buffers, True)
        qk = warpgroup_mma_wait(0, deps=[qk])
        p_first, _, l_i, m_i = online_softmax(qk, own_lo, m_i, l_i, rows, cols, key_lo, program, True, CAUSAL, BOUNDED)
        p = p_operand(p_first, acc, q_t.dtype)
        mbarrier.wait(buffers.v_ready.index(i % STAGES), (i // STAGES) & 1)
    start = own_lo + 1
    for j in range(start, gl.minimum(full_lo, n_full)):
        acc, p, l_i, m_i = _fwd_step_overlap(j - origin, j, acc, p, l_i, m_i, q_t, buffers, program, rows, cols,
                                             key_lo, True, CAUSAL, BOUNDED)
    for j in range(gl.maximum(full_lo, start), n_full):
        acc, p, l_i, m_i = _fwd_step_overlap(j - origin, j, acc, p, l_i, m_i, q_t, buffers, program, rows, cols,
                                             key_lo, False, CAUSAL, BOUNDED)
    for j in range(gl.maximum(start, n_full), n_blocks):
        acc, p, l_i, m_i = _fwd_step_overlap(j - origin, j, acc, p, l_i, m_i, q_t, buffers, program, rows, cols,
                                             key_lo, True, CAUSAL, BOUNDED)
    if own_lo < n_blocks:  # the last block's P V (its V landed), and its slot
        stage = (n_blocks - 1 - origin) % STAGES
        acc = warpgroup_mma(p, buffers.v_smem.index(stage), acc)
        mbarrier.arrive(buffers.kv_empty.index(stage), count=1)
    return acc, l_i, m_i


@gluon.jit
def _fwd_consume(io, buffers, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, OVERLAP: gl.constexpr,
                 C: gl.constexpr):
    """Consumer warpgroup C: its rows of each tile the program takes, in turn."""
    CONSUMERS: gl.constexpr = buffers.q_smem.type.shape[0]
    ROWS: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[1]
    tile, n_m, n_tiles = fwd_first_tile(work, CONSUMERS * ROWS)
    t = tile * 0  # the tiles done
    base = tile * 0  # the key blocks through the ring so far: its slots and phases run on across tiles
    while tile < n_tiles:
        program = fwd_program(tile, n_m, work, CAUSAL, BOUNDED, CONSUMERS * ROWS, BLOCK_N)
        _fwd_tile(io, buffers, program, program.lo - base, t, CAUSAL, BOUNDED, OVERLAP, C)
        base += gl.maximum(program.n_blocks - program.lo, 0)
        t += 1
        tile = take_tile(t - 1, buffers, 4)


@gluon.jit
def _fwd_tile(io, buffers, program, origin, t, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, OVERLAP: gl.constexpr,
              C: gl.constexpr):
    """Consumer warpgroup C's rows start_m + 64 C .. + 63 of the program's t-th tile against its key
    blocks; key block j is ring slot j - origin."""
    q_smem = buffers.q_smem
    lo, n_blocks, T, S = program.lo, program.n_blocks, program.T, program.S
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    first = program.start_m + C * ROWS
    rows = first + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    if io.SINKS is not None:  # a sink starts every row: m = its logit (log2 units), l = its exp2(0) = 1
        m_i = gl.full([ROWS], 0.0, gl.float32, row_layout) + gl.load(io.SINKS + program.off_h) * LOG2E
        l_i = gl.full([ROWS], 1.0, gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    # the tile's key blocks lo .. n_blocks - 1 pass through the ring in order
    key_lo, own_lo, full_lo, n_full = kv_runs(program.KEY_LO, rows, first, lo, n_blocks, T, S, CAUSAL, BOUNDED, ROWS,
                                              BLOCK_N)
    q_t = q_smem.index(C)
    mbarrier.wait(buffers.q_bar.index(C), t & 1)
    # -- the key blocks: other consumers' (passed unread), masked, mask-free, masked --
    for j in range(lo, own_lo):
        skip_slot(j - origin, buffers)
    if OVERLAP:
        acc, l_i, m_i = _fwd_blocks_overlap(acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo, origin, own_lo,
                                            full_lo, n_full, CAUSAL, BOUNDED)
    else:
        for j in range(own_lo, gl.minimum(full_lo, n_full)):
            acc, l_i, m_i = _fwd_step(j - origin, j, acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo,
                                      True, CAUSAL, BOUNDED)
        for j in range(full_lo, n_full):
            acc, l_i, m_i = _fwd_step(j - origin, j, acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo,
                                      False, CAUSAL, BOUNDED)
        for j in range(gl.maximum(own_lo, n_full), n_blocks):
            acc, l_i, m_i = _fwd_step(j - origin, j, acc, l_i, m_i, q_t, buffers, program, rows, cols, key_lo,
                                      True, CAUSAL, BOUNDED)

    # -- epilogue: LSE, and O through Q's buffer --
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # rows that attend no key (and no sink): O = 0, LSE = -inf
    lse = (m_i + gl.log2(l_safe)) / LOG2E
    gl.store(io.LSE + (program.off_b * program.H + program.off_h).to(gl.int64) * T + rows, lse, mask=rows < T)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    q_t.store(o.to(q_t.dtype))  # Q's buffer is free: this warpgroup's matmuls are all done
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(io.o_desc, [program.off_b, program.off_h, first, 0],
                                    q_t.reshape([1, 1, ROWS, HEAD_DIM]))
    tma.store_wait(0)  # O has left Q's buffer: the producer may load the next tile's Q into it
    gl.thread_barrier()
    mbarrier.arrive(buffers.q_empty.index(C), count=1)


@gluon.jit
def _fwd_consume_1(io, buffers, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, OVERLAP: gl.constexpr):
    _fwd_consume(io, buffers, work, CAUSAL, BOUNDED, OVERLAP, 1)


@gluon.jit
def _fwd_consume_2(io, buffers, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, OVERLAP: gl.constexpr):
    _fwd_consume(io, buffers, work, CAUSAL, BOUNDED, OVERLAP, 2)


@gluon.jit
def _fwd_produce(io, buffers, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """The producer warp: each tile's Q tiles and K/V blocks, tile after tile; it hands out the tiles
    (schedule.hand_out_tile)."""
    CONSUMERS: gl.constexpr = buffers.q_smem.type.shape[0]
    ROWS: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[1]
    tile, n_m, n_tiles = fwd_first_tile(work, CONSUMERS * ROWS)
    t = tile * 0
    base = tile * 0  # as the consumers count it
    while tile < n_tiles:
        program = fwd_program(tile, n_m, work, CAUSAL, BOUNDED, CONSUMERS * ROWS, BLOCK_N)
        _fwd_load_tile(io, buffers, program, program.lo - base, t)
        base += gl.maximum(program.n_blocks - program.lo, 0)
        t += 1
        # the first num_programs tiles went out at launch: a forward tile waits on no other
        tile = hand_out_tile(t - 1, gl.num_programs(0), work, buffers)


@gluon.jit
def _load_kv(i, j, io, buffers, program):
    """The program's key block j into ring slot i once the consumers have freed it."""
    k_desc, v_desc, k_smem, v_smem = io.k_desc, io.v_desc, buffers.k_smem, buffers.v_smem
    k_ready, v_ready, kv_empty = buffers.k_ready, buffers.v_ready, buffers.kv_empty
    off_b, off_hkv = program.off_b, program.off_hkv
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    stage = i % STAGES
    mbarrier.wait(kv_empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, j * BLOCK_N, 0], k_ready.index(stage),
                                    k_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, j * BLOCK_N, 0], v_ready.index(stage),
                                    v_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))


@gluon.jit
def _fwd_load_tile(io, buffers, program, origin, t):
    """The t-th tile's loads: its first key block (into the ring while the consumers may still be
    on the last tile), each consumer's Q once that consumer's last O has left its buffer, then the
    other key blocks; key block j goes to ring slot j - origin."""
    q_desc, q_smem, q_bar, q_empty = io.q_desc, buffers.q_smem, buffers.q_bar, buffers.q_empty
    off_b, lo, n_blocks = program.off_b, program.lo, program.n_blocks
    CONSUMERS: gl.constexpr = q_smem.type.shape[0]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    n_first = gl.minimum(n_blocks, lo + 1)
    for j in range(lo, n_first):
        _load_kv(j - origin, j, io, buffers, program)
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(q_empty.index(c), (t & 1) ^ 1)
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, program.off_h, program.start_m + c * ROWS, 0], q_bar.index(c),
                                        q_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]))
    for j in range(n_first, n_blocks):
        _load_kv(j - origin, j, io, buffers, program)


@gluon.jit
def _fwd_kernel(
    q_desc, k_desc, v_desc,  # TMA descriptors of (B, H, T, D), (B, H_kv, S, D) x2
    o_desc,  # of (B, H, T, D): the output
    LSE,  # (B, H, T) fp32, natural log
    COUNTER,  # (1,) int32, zero: the tiles handed out
    KEY_LO,  # (B, T) int32: each query's first key (documents, a window; kernels/masking.py's Bounds), or None
    SINKS,  # (H,) fp32: each head's sink logit, in every row's softmax (kernels/score_mods.py), or None
    sizes,  # (H, B, GROUP, T, S)
    qk_scale,  # softmax_scale * log2(e)
    CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    SECTION: gl.constexpr,  # the (batch, head) pairs per L2 section (config.fwd_section)
    OVERLAP: gl.constexpr,  # config.Row.fwd_overlap
):
    BOUNDED: gl.constexpr = KEY_LO is not None
    H, B, GROUP, T, S = sizes
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_tile)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_tile)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_tile)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # every consumer frees the slot
    for s in gl.static_range(2):
        mbarrier.init(tile_ready.index(s), count=1)
        mbarrier.init(tile_empty.index(s), count=CONSUMERS)

    io = FwdIO(q_desc, k_desc, v_desc, o_desc, LSE, SINKS)
    buffers = FwdBuffers(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem, tile_ready,
                         tile_empty)
    work = FwdWork(COUNTER, KEY_LO, H, B, GROUP, T, S, qk_scale, SECTION)
    # -- the partitions: consumer 0 in the kernel's own warps, the others and the producer beside it --
    if CONSUMERS == 2:
        gl.warp_specialize([(_fwd_consume, (io, buffers, work, CAUSAL, BOUNDED, OVERLAP, 0)),
                            (_fwd_consume_1, (io, buffers, work, CAUSAL, BOUNDED, OVERLAP)),
                            (_fwd_produce, (io, buffers, work, CAUSAL, BOUNDED))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_fwd_consume, (io, buffers, work, CAUSAL, BOUNDED, OVERLAP, 0)),
                            (_fwd_consume_1, (io, buffers, work, CAUSAL, BOUNDED, OVERLAP)),
                            (_fwd_consume_2, (io, buffers, work, CAUSAL, BOUNDED, OVERLAP)),
                            (_fwd_produce, (io, buffers, work, CAUSAL, BOUNDED))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# launching


def _options(causal: bool, tiles: config.FwdTiles, section: int, head_dim: int) -> dict:
    """The kernel's constexprs and compile options for these tiles, order (config.fwd_section) and
    head dim (config.Row.fwd_overlap)."""
    maxnreg, consumer_regs = config.fwd_registers(tiles.consumers)
    return dict(CAUSAL=causal, CONSUMERS=tiles.consumers, STAGES=tiles.stages,
                CONSUMER_REGS=consumer_regs, SECTION=section, OVERLAP=config.TABLE[head_dim].fwd_overlap,
                num_warps=4, maxnreg=maxnreg)


def _section(q, k) -> int:
    (B, H, _, D), (H_kv, S) = q.shape, k.shape[1:3]
    return config.fwd_section(B * H, H // H_kv, S, D, q.element_size())


def _grid(q, tiles: config.FwdTiles, chip: chips.Chip) -> tuple[int]:
    """One program per SM, or per tile, whichever is fewer."""
    B, H, T, _ = q.shape
    n_m = triton.cdiv(T, tiles.consumers * config.FWD_ROWS)
    return (min(n_m * H * B, chip.sms),)


def _args(q, k, v, o, lse, counter, key_lo, sinks, scale: float, tiles: config.FwdTiles) -> tuple:
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    rows = config.FWD_ROWS
    return (descriptor(q, [1, 1, rows, D]), descriptor(k, [1, 1, tiles.block_n, D]),
            descriptor(v, [1, 1, tiles.block_n, D]), descriptor(o, [1, 1, rows, D]), lse, counter, key_lo, sinks,
            (H, B, H // H_kv, T, S), scale * LOG2E.value)


def forward(q, k, v, o, lse, causal: bool, scale: float, key_lo: torch.Tensor | None, signature: tuple,
            sinks: torch.Tensor | None = None) -> None:
    """Writes o (shaped like q, head dim contiguous) and lse ((B, H, T) fp32, contiguous, natural
    log). key_lo ((B, T) int32, contiguous; causal only): each query's first key, to attend within
    documents or a window (kernels/masking.py's Bounds.key_lo). sinks: (H,) fp32 logits, in every
    row's softmax and so in the LSE, or None. signature: kernels/api.py's, which fixes all the
    launch depends on but the addresses."""
    # zeroed for each launch: a counter kept from call to call and left zero by every launch would
    # break under CUDA graphs (a capture records its launches, and a graph's pool may reuse memory)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    # the compiled forward per call signature: later calls launch it directly with descriptors over
    # the new addresses, where Triton's front door would bind every argument again and
    # TensorDescriptor would re-check what the signature fixes
    if bound := PREPARED.get((forward, signature)):
        bound(q, k, v, o, lse, counter, key_lo, sinks)
        return
    tiles = config.fwd_tiles(q.shape[3], q.shape[2])
    args = _args(q, k, v, o, lse, counter, key_lo, sinks, scale, tiles)
    options = _options(causal, tiles, _section(q, k), q.shape[3])
    grid = _grid(q, tiles, chips.chip(q.device.index))
    with on_device(q):
        PREPARED[(forward, signature)] = launch_and_bind(_fwd_kernel, grid, args, options)


def compile_only(q, k, v, causal: bool, bounded: bool = False, sinks: bool = False):
    """The compiled forward kernel for these inputs' layout, without launching it (scripts/sm90.py)."""
    (B, H, T, D) = q.shape
    tiles = config.fwd_tiles(D, T)
    key_lo = torch.empty((B, T), dtype=torch.int32) if bounded else None
    args = _args(q, k, v, torch.empty_like(q), torch.empty((B, H, T), dtype=torch.float32),
                 torch.zeros(1, dtype=torch.int32), key_lo, torch.zeros(H) if sinks else None, D ** -0.5, tiles)
    return _fwd_kernel.warmup(*args, grid=_grid(q, tiles, chips.H100), **_options(causal, tiles, _section(q, k), D))
