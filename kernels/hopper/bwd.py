"""The FlashAttention backward for Hopper (sm_90) in Gluon: dQ, dK, dV in one warp-specialized
kernel of 5 matmuls per tile pair (the portable kernels/triton/bwd.py runs 7, in two kernels).

A tile is a K/V block (BLOCK_N keys of one kv head) and every Q/dO block that sees it, of every
query head of its group. One program per SM takes tile after tile in launch order from a counter
zeroed for the launch, and the next tile's first Q/dO loads run during this one's last steps. A
producer warp issues the TMA copies into a STAGES-deep ring; two matmul warpgroups hold each step
by keys, transposed as FlashAttention-3 does: S^T = K Q^T, P^T from the forward's LSE,
dP^T = V dO^T, dV += P^T dO, dK += dS^T Q (P^T and dS^T kept in registers as the A operands) and
a dQ share dS K; a dQ-writer warp adds each share to an fp32 accumulator with one TMA reduce-add,
in a fixed order, so that dQ has the same bits every run. dK and dV stay in registers to the
tile's end. The tiles go out shortest or (causal at D = 128) longest first, in sections of
pairs (config.bwd_section), and the fixed order of dQ's adds follows that order: a share waits
only on tiles already taken by programs that run.
Two Triton passes (bwd_passes.py) run around it: LSE * log2(e) and delta = rowsum(dO * O) laid
out for TMA before, dQ scaled out of the accumulator after. The derivation: docs/flash-attention.md.
"""

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.hopper import bwd_passes as passes
from kernels.hopper import config
from kernels.hopper.blocks import descriptor, dq_layout, tile_masked, visible_t
from kernels.hopper.bwd_dq import hand_dq, write_dq
from kernels.hopper.pipeline import BwdBuffers, BwdIO
from kernels.hopper.schedule import BwdWork, bwd_program, bwd_step_rows, bwd_tiles, hand_out_tile, take_tile
from kernels.hopper.softmax import column_halves, probs_t
from kernels.masking import Bounds
from kernels.runtime import chips
from kernels.runtime.internals import Address
from kernels.runtime.launch import PREPARED, Bound, launch_and_bind, on_device
from kernels.triton.blocks import LOG2E

BWD_WARPS, WORKER_REGS = gl.constexpr(config.BWD_WARPS), gl.constexpr(config.WORKER_REGS)
ORDER_AT = gl.constexpr(passes.ORDER_AT)
# each head dim's Q/dO ring depth, a constexpr global: Triton keys its cache on the values
STAGES_OF = gl.constexpr({head_dim: row.bwd.stages for head_dim, row in config.TABLE.items()})

# --------------------------------------------------------------------------------------------
# the partitions


@gluon.jit
def _issue_tile(q_desc, do_desc, aux_desc, bar, q_buf, do_buf, lse_buf, delta_buf, off_b, off_h, start_m):
    """One step's Q, dO, LSE and delta rows, by TMA, completing on `bar`."""
    BLOCK_M: gl.constexpr = q_buf.type.shape[0]
    HEAD_DIM: gl.constexpr = q_buf.type.shape[1]
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * aux_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, off_h, start_m, 0], bar, q_buf.reshape([1, 1, BLOCK_M, HEAD_DIM]))
    tma.async_copy_global_to_shared(do_desc, [off_b, off_h, start_m, 0], bar, do_buf.reshape([1, 1, BLOCK_M,
                                                                                               HEAD_DIM]))
    tma.async_copy_global_to_shared(aux_desc, [off_b, off_h, 0, start_m], bar, lse_buf)
    tma.async_copy_global_to_shared(aux_desc, [off_b, off_h, 1, start_m], bar, delta_buf)


@gluon.jit
def _bwd_produce(io, buffers, work, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """The producer warp: each tile's K and V and its steps' Q, dO, LSE and delta, tile after tile,
    every one taken from the counter and handed to the other partitions (schedule.hand_out_tile),
    the first too: a tile then goes only to a program that is running, and a share of dQ's order
    never waits on a program that has no SM yet (another kernel may hold some)."""
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[0]
    n_blocks, n_tiles = bwd_tiles(work, BLOCK_N)
    t = gl.program_id(0) * 0  # the tiles done
    base = t  # the steps through the ring so far: its slots and phases run on across tiles
    tile = hand_out_tile(t, 0, work, buffers)
    while tile < n_tiles:
        program, _, _, _ = bwd_program(tile, n_blocks, work, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
        _bwd_load_tile(io, buffers, program, base, t)
        base += program.steps * program.GROUP
        t += 1
        tile = hand_out_tile(t, 0, work, buffers)


@gluon.jit
def _bwd_load_tile(io, buffers, program, base, t):
    """The t-th tile's loads: its first STAGES steps' tiles (while the matmul warps may still be on
    the last tile), its K and V once those warps are done with the last tile's, then the other
    steps'; step j goes to ring slot base + j."""
    STAGES: gl.constexpr = buffers.q_smem.type.shape[0]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = buffers.k_smem.type.shape[1]
    total = program.steps * program.GROUP
    n_first = gl.minimum(total, STAGES)
    for j in range(n_first):
        _load_step(j, base + j, io, buffers, program)
    kv_bar = buffers.kv_bar
    mbarrier.wait(buffers.kv_empty, (t & 1) ^ 1)  # a fresh barrier passes phase 1
    mbarrier.expect(kv_bar, 2 * io.k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(io.k_desc, [program.off_b, program.off_hkv, program.n * BLOCK_N, 0], kv_bar,
                                    buffers.k_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
    tma.async_copy_global_to_shared(io.v_desc, [program.off_b, program.off_hkv, program.n * BLOCK_N, 0], kv_bar,
                                    buffers.v_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
    for j in range(n_first, total):
        _load_step(j, base + j, io, buffers, program)


@gluon.jit
def _load_step(j, r, io, buffers, program):
    """Step j's Q, dO, LSE and delta into ring slot r once the matmul warps have freed it."""
    STAGES: gl.constexpr = buffers.q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    stage = r % STAGES
    mbarrier.wait(buffers.empty.index(stage), ((r // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
    off_h, start_m = bwd_step_rows(j, program, BLOCK_M)
    _issue_tile(io.q_desc, io.do_desc, io.aux_desc, buffers.ready.index(stage), buffers.q_smem.index(stage),
                buffers.do_smem.index(stage), buffers.lse_smem.index(stage), buffers.delta_smem.index(stage),
                program.off_b, off_h, start_m)


@gluon.jit
def _landed(j, q_smem, do_smem, ready):
    """Step j's Q and dO tiles in the ring, once they have landed."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    return q_smem.index(stage), do_smem.index(stage)


@gluon.jit
def _bwd_consume(buffers, work, outs, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The matmul warps: the steps of each tile they are handed (_bwd_tile)."""
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = buffers.k_smem.type.shape[0]
    n_blocks, n_tiles = bwd_tiles(work, BLOCK_N)
    t = gl.program_id(0) * 0
    base = t  # as the producer counts it
    tile = take_tile(t, buffers, NUM_WARPS)
    while tile < n_tiles:
        program, row_hi, full_hi, key_lo = bwd_program(tile, n_blocks, work, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
        _bwd_tile(buffers, program, outs, (row_hi, full_hi, key_lo), base, t, CAUSAL, BOUNDED, NUM_WARPS)
        base += program.steps * program.GROUP
        t += 1
        tile = take_tile(t, buffers, NUM_WARPS)


@gluon.jit
def _kv_read(kv_empty):
    """The tile's K and V are read to the end (every warp's matmuls waited for): the producer may
    load the next tile's."""
    gl.thread_barrier()
    mbarrier.arrive(kv_empty, count=1)


@gluon.jit
def _bwd_tile(buffers, program, outs, row_bounds, base, t, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr,
              NUM_WARPS: gl.constexpr):
    """The t-th tile with S^T by keys (two warpgroups, one wgmma M of BLOCK_N keys; BLOCK_M = 64
    at D = 128, 128 at D = 64): the five products of every step, P^T and dS^T kept in registers as
    dV's and dK's A operands, dK and dV in registers to the end, each dQ share handed to the
    writer; step j is ring slot base + j."""
    k_smem, v_smem, q_smem, do_smem = buffers.k_smem, buffers.v_smem, buffers.q_smem, buffers.do_smem
    n, steps, GROUP, T, S = program.n, program.steps, program.GROUP, program.T, program.S
    ROW_HI, full_hi, _ = row_bounds  # the batch row's row_hi; the first key's, from which rows need the mask
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    start_n = n * BLOCK_N

    # wgmma accumulators: (BLOCK_N, BLOCK_M) for S^T and dP^T, (BLOCK_N, D) for dK and dV,
    # (BLOCK_M, D) for a dQ share; P^T and dS^T feed dV and dK as register A operands (the steps')
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    acc_layout: gl.constexpr = dq_layout(BLOCK_M, HEAD_DIM, NUM_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # a vector over S^T's columns: queries

    offs_m_t = gl.arange(0, BLOCK_M, layout=row_layout)
    cols_t = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # S^T's rows: keys
    zero_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    # under a causal mask a tile needs masking where a key may follow a query, bounded where its
    # rows reach full_hi (the first key's row_hi: a document's end, or the window's); the last key block
    # may reach past S, whose zero keys would otherwise get weight exp2(-LSE)
    past_s = start_n + BLOCK_N > S
    row_hi = cols_t
    if BOUNDED:
        row_hi = gl.load(ROW_HI + cols_t, mask=cols_t < S, other=0)
    tile_t = (cols_t, offs_m_t, row_hi)
    mbarrier.wait(buffers.kv_bar, t & 1)
    for j in range(steps * GROUP):
        off_h, start_m = bwd_step_rows(j, program, BLOCK_M)
        r = base + j
        stage = r % STAGES
        # -- S^T = K Q^T and dP^T = V dO^T, both in flight --
        q_t, do_t = _landed(r, q_smem, do_smem, buffers.ready)
        st = warpgroup_mma(k_smem, q_t.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_t.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        masked = tile_masked(start_m, start_n, past_s, full_hi, T, S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
        if BLOCK_M == 64:
            dk, dv = _step_by_rows(st, dpt, q_t, do_t, dk, dv, buffers, r, start_m, masked, tile_t, outs, program,
                                   CAUSAL, BOUNDED)
        else:
            dk, dv = _step_by_halves(st, dpt, q_t, do_t, dk, dv, buffers, r, start_m, masked, tile_t, outs, program,
                                     CAUSAL, BOUNDED)
        ds_buf = buffers.ds_smem.index(r % 2)
        fence_async_shared()
        gl.thread_barrier()
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, zero_q, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
        mbarrier.arrive(buffers.empty.index(stage), count=1)  # Q and dO are read: the producer may refill
        hand_dq(r, dq, buffers.dq_smem, buffers.dq_full, buffers.dq_empty)
    _kv_read(buffers.kv_empty)
    _store_dkv(dk, dv, outs, program.off_b, program.off_hkv, start_n, S)


@gluon.jit
def _step_by_rows(st, dpt, q_t, do_t, dk, dv, buffers, r, start_m, masked, tile_t, outs, program,
                  CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """A step of 64 queries (the D = 128 step), ring slot r, S^T and dP^T in flight: P^T from the
    LSE, dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q, and dS^T into the writer's buffer
    r % 2 for dQ's share (two buffers: the barrier after also ends step r - 1's reads). Returns
    dK, dV."""
    STAGES: gl.constexpr = buffers.q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    dtype: gl.constexpr = q_t.dtype
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    cols_t, offs_m_t, row_hi = tile_t  # S^T's rows (keys), its columns (query offsets), the keys' row_hi
    row_layout: gl.constexpr = offs_m_t.type.layout
    T, S, qk_scale = program.T, program.S, outs[5]
    # rows past T arrive as zero Q and dO with LSE = delta = 0: P = 1 there but dP = dS = 0, dO = 0
    lse = buffers.lse_smem.index(r % STAGES).reshape([BLOCK_M]).load(row_layout)
    st = warpgroup_mma_wait(1, deps=[st])
    pt = gl.exp2(st * qk_scale - lse[None, :])
    # selected after exp2: a row with LSE = -inf (it sees no key) is dropped, never NaN
    if masked:
        pt = gl.where(visible_t(cols_t, start_m, offs_m_t, T, S, row_hi, CAUSAL, BOUNDED), pt, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_t, dv, is_async=True)
    delta = buffers.delta_smem.index(r % STAGES).reshape([BLOCK_M]).load(row_layout)
    dpt = warpgroup_mma_wait(1, deps=[dpt])
    ds_lo = (pt * (dpt - delta[None, :])).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds_lo, a_layout), q_t, dk, is_async=True)
    buffers.ds_smem.index(r % 2).store(ds_lo)
    return dk, dv


@gluon.jit
def _step_by_halves(st, dpt, q_t, do_t, dk, dv, buffers, r, start_m, masked, tile_t, outs, program,
                    CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """A step of 128 queries (FlashAttention-3's D = 64 step), ring slot r, S^T and dP^T in flight
    whole, one m64n128 product each: P^T, dS^T, dV and dK one 64-query column half at a time, so a
    thread holds 16 LSE and 16 delta values at once, not 32 each (which spill). Returns dK, dV."""
    cols_t, _, row_hi = tile_t  # S^T's rows (keys) and their row_hi (the query offsets: made per half)
    STAGES: gl.constexpr = buffers.q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = buffers.q_smem.type.shape[1]
    gl.static_assert(BLOCK_M == 128)
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_t.dtype
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    T, S, qk_scale = program.T, program.S, outs[5]
    lse_row = buffers.lse_smem.index(r % STAGES).reshape([BLOCK_M])
    delta_row = buffers.delta_smem.index(r % STAGES).reshape([BLOCK_M])
    ds_buf = buffers.ds_smem.index(r % 2)
    st = warpgroup_mma_wait(1, deps=[st])
    st0, st1 = column_halves(st)
    query_layout: gl.constexpr = gl.SliceLayout(0, st0.type.layout)  # a vector over a half's queries
    pt0 = probs_t(st0, lse_row.slice(0, HALF).load(query_layout), start_m, 0, cols_t, row_hi, masked, qk_scale, T, S,
                  CAUSAL, BOUNDED)
    dv = warpgroup_mma(gl.convert_layout(pt0.to(dtype), a_layout), do_t.slice(0, HALF), dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=[dpt])
    dpt0, dpt1 = column_halves(dpt)
    ds0 = (pt0 * (dpt0 - delta_row.slice(0, HALF).load(query_layout)[None, :])).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds0, a_layout), q_t.slice(0, HALF), dk, is_async=True)
    ds_buf.slice(0, HALF, dim=1).store(ds0)
    pt1 = probs_t(st1, lse_row.slice(HALF, HALF).load(query_layout), start_m, HALF, cols_t, row_hi, masked, qk_scale,
                  T, S, CAUSAL, BOUNDED)
    dv = warpgroup_mma(gl.convert_layout(pt1.to(dtype), a_layout), do_t.slice(HALF, HALF), dv, is_async=True)
    ds1 = (pt1 * (dpt1 - delta_row.slice(HALF, HALF).load(query_layout)[None, :])).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds1, a_layout), q_t.slice(HALF, HALF), dk, is_async=True)
    ds_buf.slice(HALF, HALF, dim=1).store(ds1)
    return dk, dv


@gluon.jit
def _store_dkv(dk, dv, outs, off_b, off_hkv, start_n, S):
    """The epilogue: dK * scale and dV, (BLOCK_N, D) each, to the program's keys below S."""
    DK, DV, dk_strides, dv_strides, sm_scale, _ = outs
    BLOCK_N: gl.constexpr = dk.type.shape[0]
    HEAD_DIM: gl.constexpr = dk.type.shape[1]
    kv_layout: gl.constexpr = dk.type.layout
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    key_ok = offs_n[:, None] < S
    kv_rows = offs_n[:, None].to(gl.int64)
    stride_dkb, stride_dkh, stride_dkn = dk_strides
    dk_ptrs = DK + off_b.to(gl.int64) * stride_dkb + off_hkv.to(gl.int64) * stride_dkh + kv_rows * stride_dkn
    gl.store(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    stride_dvb, stride_dvh, stride_dvn = dv_strides
    dv_ptrs = DV + off_b.to(gl.int64) * stride_dvb + off_hkv.to(gl.int64) * stride_dvh + kv_rows * stride_dvn
    gl.store(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)


@gluon.jit
def _bwd_kernel(
    q_desc, k_desc, v_desc, do_desc,  # TMA descriptors of (B, H, T, D), (B, H_kv, S, D) x2, (B, H, T, D)
    aux_desc,  # of (B, H, 2, T_pad) fp32: LSE * log2(e) and delta = rowsum(dO * O), zero past T
    dqacc_desc,  # of (lines, 256) fp32, zeroed: the dQ shares added so far, in slabs (bwd_passes.py)
    COUNTS,  # (ORDER_AT + B * H * cdiv(T, BLOCK_M)) int32, zeroed: COUNTS[0] the tiles handed out (every
    # one, the first too), and from ORDER_AT on how many writer lanes have released a share, per Q block
    DK, DV,  # outputs, (B, H_kv, S, D) with these strides (head dim contiguous)
    KEY_LO, ROW_HI,  # (B, T), (B, S) int32: each query's first key; one past the last query that sees
    # each key (documents, a window; kernels/masking.py's Bounds), or None, None
    out_strides,  # (dk, dv) strides, each (batch, head, key)
    sizes,  # (H, B, GROUP, T, S)
    scales,  # (softmax_scale, softmax_scale * log2(e))
    CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr,
):
    BOUNDED: gl.constexpr = KEY_LO is not None
    H, B, GROUP, T, S = sizes
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    STAGES: gl.constexpr = STAGES_OF[HEAD_DIM]

    m_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    n_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    ds_shape: gl.constexpr = [BLOCK_N, BLOCK_M]  # dS^T, twice: a step's, while the next step's is written
    ds_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for(ds_shape, dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], n_tile)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], n_tile)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], m_tile)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], m_tile)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, 1, BLOCK_M], aux_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, 1, BLOCK_M], aux_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2] + ds_shape, ds_tile)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dqacc_desc.block_type.shape, dqacc_desc.layout)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for b in gl.static_range(2):
        mbarrier.init(dq_full.index(b), count=1)
        mbarrier.init(dq_empty.index(b), count=1)
        mbarrier.init(tile_ready.index(b), count=1)
        mbarrier.init(tile_empty.index(b), count=2)  # the matmul warps and the dQ writer read each

    io = BwdIO(q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc)
    buffers = BwdBuffers(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, kv_empty,
                         ready, empty, dq_full, dq_empty, tile_smem, tile_ready, tile_empty)
    work = BwdWork(COUNTS, KEY_LO, ROW_HI, H, B, GROUP, T, S, LONGEST_FIRST)
    dk_strides, dv_strides = out_strides
    sm_scale, qk_scale = scales
    outs = (DK, DV, dk_strides, dv_strides, sm_scale, qk_scale)
    # -- the partitions: the matmul warpgroups in the kernel's own warps, the producer and the dQ writer beside --
    gl.warp_specialize([(_bwd_consume, (buffers, work, outs, CAUSAL, BOUNDED, BWD_WARPS)),
                        (_bwd_produce, (io, buffers, work, CAUSAL, BOUNDED)),
                        (write_dq, (io, buffers, work, COUNTS + ORDER_AT, CAUSAL, BOUNDED))],
                       [1, 1], [WORKER_REGS, WORKER_REGS])


# --------------------------------------------------------------------------------------------
# launching


class _Launches(NamedTuple):
    """A layout's three launches, bound, and where its buffers lie in their one allocation."""
    aux: Bound  # the LSE-delta pass (it zeroes the accumulator and the counters too)
    main: Bound  # the backward kernel
    dq: Bound  # the dQ pass
    floats: int  # the size of the buffers' allocation
    offsets: tuple[int, ...]  # bytes from its start to each of passes.buffers' views


def _launch(do, q, k, v, o, lse, dq, dk, dv, bounds: Bounds | None, causal: bool, scale: float, longest_first: int,
            warmup: bool = False):
    """Launches the backward (the LSE-delta pass, the kernel, the dQ pass) through Triton's front
    door and returns the three launches bound for later calls of this layout (or, with warmup,
    only compiles the backward kernel and returns it). bounds: as backward's; longest_first:
    config.bwd_section's choice."""
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    tiles = config.TABLE[D].bwd
    scratch, views = passes.buffers(q, tiles.block_m, "cpu" if warmup else q.device)
    aux, dq_acc, counts, zeroed = views
    if not warmup:
        aux_grid, aux_args = passes.lse_delta_launch(o, do, lse, aux, zeroed, tiles.block_m)
        aux_bound = launch_and_bind(passes.lse_delta_kernel, aux_grid, aux_args)
    key_lo, row_hi = _lo_hi(bounds)
    args = (descriptor(q, [1, 1, tiles.block_m, D]), descriptor(k, [1, 1, tiles.block_n, D]),
            descriptor(v, [1, 1, tiles.block_n, D]), descriptor(do, [1, 1, tiles.block_m, D]),
            descriptor(aux, [1, 1, 1, tiles.block_m]),
            descriptor(dq_acc, [tiles.block_m * D // passes.LINE, passes.LINE], swizzled=False), counts, dk, dv,
            key_lo, row_hi, (dk.stride()[:3], dv.stride()[:3]), (H, B, H // H_kv, T, S),
            (scale, scale * LOG2E.value))
    options = dict(CAUSAL=causal, LONGEST_FIRST=longest_first, num_warps=config.BWD_WARPS,
                   maxnreg=config.bwd_maxnreg())
    n_tiles = triton.cdiv(S, tiles.block_n) * H_kv * B
    grid = (min(n_tiles, (chips.H100 if warmup else chips.chip(q.device.index)).sms),)  # a program per SM, or per tile
    if warmup:
        return _bwd_kernel.warmup(*args, grid=grid, **options)
    bwd_bound = launch_and_bind(_bwd_kernel, grid, args, options)
    dq_grid, dq_args = passes.dq_launch(dq_acc, dq, scale, tiles.block_m)
    return _Launches(aux_bound, bwd_bound, launch_and_bind(passes.dq_kernel, dq_grid, dq_args), scratch.numel(),
                     tuple(view.data_ptr() - scratch.data_ptr() for view in views))


def _lo_hi(bounds: Bounds | None) -> tuple:
    """(key_lo, row_hi) of the Bounds, the halves these kernels read, or (None, None)."""
    return (bounds.key_lo, bounds.row_hi) if bounds else (None, None)


def backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, bounds: Bounds | None,
             signature: tuple) -> None:
    """Writes dq, dk, dv (shaped like q, k, v; head dim contiguous) from the forward's o and lse
    ((B, H, T) fp32, contiguous), the same bits every run. bounds: None, or (causal only)
    kernels/masking.py's Bounds, to attend within documents or a window. signature: kernels/api.py's,
    which fixes all the launches depend on but the addresses. Rows that see no key (causal, T > S)
    get no share: their dq is zero."""
    if launches := PREPARED.get((backward, signature)):  # bound as the forward's are
        # the buffers by address alone: the launches read nothing else of them
        scratch = torch.empty(launches.floats, dtype=torch.float32, device=q.device)
        base = scratch.data_ptr()
        aux, dq_acc, counts, zeroed = (Address(base + offset) for offset in launches.offsets)
        launches.aux(o, do, lse, aux, zeroed)
        launches.main(q, k, v, do, aux, dq_acc, counts, dk, dv, *_lo_hi(bounds))
        launches.dq(dq_acc, dq)
        return
    longest_first = config.bwd_section(q.shape[3], causal, bounds is not None)
    with on_device(q):
        PREPARED[(backward, signature)] = _launch(do, q, k, v, o, lse, dq, dk, dv, bounds, causal, scale,
                                                  longest_first)


def compile_only(do, q, k, v, causal: bool, bounded: bool = False):
    """The compiled kernel for these inputs' layout, without launching it (scripts/sm90.py)."""
    (B, H, T, D), S = q.shape, k.shape[2]
    bounds = Bounds(torch.empty((2, B, T), dtype=torch.int32), torch.empty((2, B, S), dtype=torch.int32)) \
        if bounded else None
    o, dq, dk, dv, lse = (*map(torch.empty_like, (q, q, k, v)), torch.empty((B, H, T), dtype=torch.float32))
    return _launch(do, q, k, v, o, lse, dq, dk, dv, bounds, causal, D ** -0.5,
                   config.bwd_section(D, causal, bounded), warmup=True)
