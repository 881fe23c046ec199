"""FlashAttention for Hopper (sm_90) in Gluon: a warp-specialized forward (see the forward's
section below) and a warp-specialized backward of one kernel with 5 matmuls per tile pair.

The portable backward (kernels/flash_attn.py) runs two kernels, one owning K/V blocks and one
owning Q blocks, so that every output element has a single writer; both recompute QK^T and dO V^T
(7 matmuls per tile pair). Here one program owns a K/V block (BLOCK_N keys of one kv head) and
streams every Q/dO block that sees it, of every query head of its group:

    S^T  = K Q^T             (BLOCK_N, BLOCK_M)   wgmma, K and Q from shared memory
    P^T  = exp2(S^T * scale * log2(e) - LSE)      LSE from the forward: no softmax pass
    dP^T = V dO^T            (BLOCK_N, BLOCK_M)
    dS^T = P^T * (dP^T - delta)                   delta = rowsum(dO * O), computed beforehand
    dV  += P^T dO            (BLOCK_N, D)         A operand straight from registers
    dK  += dS^T Q            (BLOCK_N, D)
    dQ_j = dS K              (BLOCK_M, D)         dS^T goes through shared memory, read transposed

dK and dV stay in registers until the end. dQ_j is one K/V block's share of a Q block's dQ, so
programs must add their shares up, into an fp32 accumulator that a final pass scales and casts.
Unordered float atomics would make dQ differ run to run; here the adds to each Q block happen in
a fixed order, longest key index first: a counter per (batch, head, Q block) says how many shares
have landed, and program n adds only when it reaches (number of programs after n that see that
block). Programs are launched in the same order, so a program waits only for programs that
started before it (no deadlock on a full GPU), and under a causal mask the shortest programs (the
last key blocks) lead, which is the order in which each Q block's shares become ready. With
deterministic=False each share is added as soon as it is ready (the reduce-add is atomic), which
is what the ordering costs to measure.

Packed documents and sliding windows (causal) bound each query's keys from below, by a bound that
grows with the query (kernels/flash_attn.py's Bounds): a key block's program streams only the Q
blocks before its last key's row_hi, and a query block's program loads only the key blocks from
its first row's key_lo on, so tiles of other documents and outside the window are never loaded.
Within the causal mask one comparison per element is left: query i sees key j <= i iff
j >= key_lo(i) (the forward), or iff i < row_hi(j) (the backward).

The work is split FlashAttention-3's way (warp specialization): a producer warp issues the TMA
copies, the two matmul warpgroups do the five products, and a dQ-writer warp waits for each
share's turn and adds it with one TMA reduce-add, so that neither the copies nor the ordered adds
stall the matmul warps. The two 1-warp workers share a warpgroup at 24 registers each, leaving 240
per matmul thread.

Q, dO, LSE and delta tiles arrive by TMA into a STAGES-deep ring of shared-memory buffers, each
guarded by a ready and an empty mbarrier; each share of dQ goes to the writer through one of two
shared-memory buffers, guarded the same way. Host-side TMA descriptors over the (B, H, T, D)
tensors (any strides with a contiguous head dim, 16-byte aligned) bound each head's rows: rows
past T and keys past S arrive as zeros.

Triton 3.6's Gluon (triton.experimental.gluon) is the language; Gluon has no interpreter, so this
file runs only on an sm_90 GPU. kernels/flash_attn.py decides which of its kernels run.
tests/test_hopper.py compiles it for sm_90 on any machine (kernels/sm90.py stands in for the GPU)
and checks it numerically where one is present.
"""

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.launch import launch_compiled

_LOG2E = gl.constexpr(math.log2(math.e))
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
# head dim -> (BLOCK_M, BLOCK_N, STAGES): query rows per step, keys per program, depth of the
# Q/dO ring; the matmul warps are 8 (two warpgroups)
BLOCKS = {64: (64, 128, 3), 128: (64, 128, 2)}
NUM_WARPS = 8


@gluon.constexpr_function
def _dq_layout(block_m, head_dim, num_warps):
    """The (BLOCK_M, D) accumulator's wgmma layout: 16-row slices over 4 warps per 64 rows, the
    remaining warps splitting D."""
    along_m = min(num_warps, block_m // 16)
    along_d = num_warps // along_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_m, along_d],
                                     instr_shape=[16, head_dim // along_d, 16])


@gluon.jit
def _load_acquire(ptrs):
    """ld.acquire.gpu of int32 pointers: what later loads and adds see follows what it read."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bulk_done(like):
    """Waits for this thread's TMA stores and reductions to complete (their writes done, not only
    their shared-memory reads, as tma.store_wait waits for), and orders them before what follows."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
                                     "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared memory `src` into the descriptor's box at `coord` (triton 3.6's
    Gluon builds the op but exposes no wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


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
def _bwd_step_rows(j, steps, m_lo, off_hkv, GROUP, BLOCK_M: gl.constexpr):
    """Step j's query head and first row: the group's heads in turn, each over Q blocks m_lo.."""
    g = j // steps
    return off_hkv * GROUP + g, (m_lo + j - g * steps) * BLOCK_M


@gluon.jit
def _bwd_produce(descs, smem, bars, coords, CAUSAL: gl.constexpr):
    """The producer warp: this program's K and V block once, then every step's Q, dO, LSE and
    delta through the STAGES-deep ring."""
    q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc = descs
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_bar, ready, empty, dq_full, dq_empty = bars
    off_b, off_hkv, n, n_blocks, m_lo, steps, H, GROUP, T, S = coords
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, n * BLOCK_N, 0], kv_bar,
                                    k_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
    tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n * BLOCK_N, 0], kv_bar,
                                    v_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
    for j in range(steps * GROUP):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        off_h, start_m = _bwd_step_rows(j, steps, m_lo, off_hkv, GROUP, BLOCK_M)
        _issue_tile(q_desc, do_desc, aux_desc, ready.index(stage), q_smem.index(stage), do_smem.index(stage),
                    lse_smem.index(stage), delta_smem.index(stage), off_b, off_h, start_m)


@gluon.jit
def _bwd_write_dq(descs, smem, bars, coords, SEM, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The dQ writer warp: adds each step's dQ share into the fp32 accumulator by one TMA
    reduce-add, in key-block order (see the module docstring), or (not DETERMINISTIC) as soon as
    it is ready, in whatever order the programs get there."""
    q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc = descs
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_bar, ready, empty, dq_full, dq_empty = bars
    off_b, off_hkv, n, n_blocks, m_lo, steps, H, GROUP, T, S = coords
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    # one lane per thread of the warp: each polls the counter and releases the share it added
    lane_zero = gl.zeros([32], gl.int32, gl.BlockedLayout([1], [32], [1], [0]))
    m_blocks = gl.cdiv(T, BLOCK_M)
    for j in range(steps * GROUP):
        off_h, start_m = _bwd_step_rows(j, steps, m_lo, off_hkv, GROUP, BLOCK_M)
        counter = SEM + (off_b * H + off_h) * m_blocks + start_m // BLOCK_M + lane_zero
        if DETERMINISTIC:
            landed = _load_acquire(counter)  # read now, its latency hidden behind the wait below
        n_hi = n_blocks - 1  # the last key block that sees this Q block adds first
        if CAUSAL:
            n_hi = gl.minimum(n_hi, (start_m + BLOCK_M - 1 + S - T) // BLOCK_N)
        turn = (n_hi - n) * 32  # every lane of every later program has released its share
        buf = j % 2
        mbarrier.wait(dq_full.index(buf), (j // 2) & 1)
        if DETERMINISTIC:
            while gl.min(landed, 0) < turn:
                landed = _load_acquire(counter)
        _tma_add(dqacc_desc, [off_b, off_h, start_m, 0], dq_smem.index(buf))
        _bulk_done(lane_zero)  # the add has landed in global memory, and its shared reads are done
        mbarrier.arrive(dq_empty.index(buf), count=1)
        if DETERMINISTIC:
            gl.atomic_add(counter, lane_zero + 1, sem="release")


@gluon.jit
def _bwd_consume(descs, smem, bars, coords, outs, bnd, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr,
                 NUM_WARPS: gl.constexpr):
    """The matmul warps (two warpgroups, one wgmma M of BLOCK_N keys): the five products of every
    step, dK and dV kept in registers and written at the end, each dQ share handed to the writer."""
    q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc = descs
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_bar, ready, empty, dq_full, dq_empty = bars
    off_b, off_hkv, n, n_blocks, m_lo, steps, H, GROUP, T, S = coords
    DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, sm_scale, qk_scale = outs
    ROW_HI, full_hi = bnd
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    start_n = n * BLOCK_N

    # wgmma accumulators: (BLOCK_N, BLOCK_M) for S^T and dP^T, (BLOCK_N, D) for dK and dV,
    # (BLOCK_M, D) for a dQ share; P^T and dS^T feed dV and dK as register A operands
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = _dq_layout(BLOCK_M, HEAD_DIM, NUM_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # a vector over S^T's columns: queries

    offs_m_t = gl.arange(0, BLOCK_M, layout=row_layout)
    cols_t = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # S^T's rows: keys
    zero_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    # under a causal mask a tile needs masking where a key may follow a query, bounded where its
    # rows reach full_hi (the first key's row_hi: a document's end, or the window's); the last key block
    # may reach past S, whose zero keys would otherwise get weight exp2(-LSE)
    past_s = start_n + BLOCK_N > S
    row_hi = cols_t
    if BOUNDED:
        row_hi = gl.load(ROW_HI + cols_t, mask=cols_t < S, other=0)
    mbarrier.wait(kv_bar, 0)
    for j in range(steps * GROUP):
        off_h, start_m = _bwd_step_rows(j, steps, m_lo, off_hkv, GROUP, BLOCK_M)
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        q_t = q_smem.index(stage)
        do_t = do_smem.index(stage)

        st = warpgroup_mma(k_smem, q_t.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_t.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        # rows past T arrive as zero Q and dO with LSE = delta = 0: P = 1 there but dP = dS = 0, dO = 0
        lse = lse_smem.index(stage).reshape([BLOCK_M]).load(row_layout)
        st = warpgroup_mma_wait(1, deps=[st])
        pt = gl.exp2(st * qk_scale - lse[None, :])
        masked = past_s
        if CAUSAL:
            masked = masked | (start_n + BLOCK_N - 1 > start_m + S - T)
        if BOUNDED:
            masked = masked | (start_m + BLOCK_M > full_hi)
        if masked:  # selected after exp2: a row with LSE = -inf (it sees no key) is dropped, never NaN
            visible = cols_t[:, None] < S
            if CAUSAL:
                visible = visible & (cols_t[:, None] <= start_m + offs_m_t[None, :] + (S - T))
            if BOUNDED:  # a query at or after a key (causal) sees it iff before the key's row_hi
                visible = visible & (start_m + offs_m_t[None, :] < row_hi[:, None])
            pt = gl.where(visible, pt, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_t, dv, is_async=True)
        delta = delta_smem.index(stage).reshape([BLOCK_M]).load(row_layout)
        dpt = warpgroup_mma_wait(1, deps=[dpt])
        ds_lo = (pt * (dpt - delta[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_lo, a_layout), q_t, dk, is_async=True)
        ds_buf = ds_smem.index(j % 2)  # two buffers: the barrier below also ends step j - 1's reads
        ds_buf.store(ds_lo)
        fence_async_shared()
        gl.thread_barrier()
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, zero_q, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
        mbarrier.arrive(empty.index(stage), count=1)  # Q and dO are read: the producer may refill

        buf = j % 2
        mbarrier.wait(dq_empty.index(buf), ((j // 2) & 1) ^ 1)  # the writer has added its last share
        dq_smem.index(buf).reshape([BLOCK_M, HEAD_DIM]).store(dq)
        fence_async_shared()  # the writer's TMA reads what these threads wrote
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(buf), count=1)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    key_ok = offs_n[:, None] < S
    kv_rows = offs_n[:, None].to(gl.int64)
    dk_ptrs = DK + off_b.to(gl.int64) * stride_dkb + off_hkv.to(gl.int64) * stride_dkh + kv_rows * stride_dkn
    gl.store(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(dtype), mask=key_ok)
    dv_ptrs = DV + off_b.to(gl.int64) * stride_dvb + off_hkv.to(gl.int64) * stride_dvh + kv_rows * stride_dvn
    gl.store(dv_ptrs + offs_d[None, :], dv.to(dtype), mask=key_ok)


@gluon.jit
def _bwd_kernel(
    q_desc, k_desc, v_desc, do_desc,  # TMA descriptors of (B, H, T, D), (B, H_kv, S, D) x2, (B, H, T, D)
    aux_desc,  # of (B, H, 2, T_pad) fp32: LSE * log2(e) and delta = rowsum(dO * O), zero past T
    dqacc_desc,  # of (B, H, T, D) fp32, zeroed: the dQ shares added so far
    SEM,  # (B, H, cdiv(T, BLOCK_M)) int32, zeroed: how many writer lanes have released a share per Q block
    ROW_HI,  # (B, S) int32: one past the last query that sees each key (BOUNDED: documents, a window)
    DK, DV,  # outputs, (B, H_kv, S, D) with these strides (head dim contiguous)
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, GROUP, T, S,
    sm_scale, qk_scale,  # softmax_scale, and softmax_scale * log2(e)
    CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, DETERMINISTIC: gl.constexpr, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, WORKER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    n_blocks = gl.num_programs(0)
    n = n_blocks - 1 - gl.program_id(0)  # last key blocks first (see the module docstring)
    off_hkv = gl.program_id(1)
    off_b = gl.program_id(2)
    # the Q blocks that see this key block, per query head: m_lo .. m_hi - 1
    m_lo = 0
    if CAUSAL:  # bottom-right: query i sees key j iff j <= i + S - T
        m_lo = gl.maximum(n * BLOCK_N + T - S, 0) // BLOCK_M
    m_hi = gl.cdiv(T, BLOCK_M)
    row_hi = ROW_HI + off_b.to(gl.int64) * S
    full_hi = T  # bounded, rows from here on need the mask
    if BOUNDED:  # rows from the last key's row_hi on see none of the keys; row_hi grows with the key
        m_hi = gl.maximum(gl.cdiv(gl.load(row_hi + gl.minimum(n * BLOCK_N + BLOCK_N, S) - 1), BLOCK_M), m_lo)
        full_hi = gl.load(row_hi + n * BLOCK_N)
    steps = m_hi - m_lo

    m_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    n_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    ds_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], n_tile)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], n_tile)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], m_tile)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], m_tile)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, 1, BLOCK_M], aux_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, 1, BLOCK_M], aux_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_tile)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_DIM], dqacc_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for b in gl.static_range(2):
        mbarrier.init(dq_full.index(b), count=1)
        mbarrier.init(dq_empty.index(b), count=1)

    descs = (q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc)
    smem = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem)
    bars = (kv_bar, ready, empty, dq_full, dq_empty)
    coords = (off_b, off_hkv, n, n_blocks, m_lo, steps, H, GROUP, T, S)
    outs = (DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, sm_scale, qk_scale)
    gl.warp_specialize([(_bwd_consume, (descs, smem, bars, coords, outs, (row_hi, full_hi), CAUSAL, BOUNDED,
                                       num_warps)),
                        (_bwd_produce, (descs, smem, bars, coords, CAUSAL)),
                        (_bwd_write_dq, (descs, smem, bars, coords, SEM, CAUSAL, DETERMINISTIC))],
                       [1, 1], [WORKER_REGS, WORKER_REGS])


@triton.jit
def _aux_kernel(O, DO, LSE, AUX, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot,
                H, T, T_PAD, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """AUX[b, h] = (LSE * log2(e), rowsum(dO * O)) over T_PAD rows, zero past T."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    ok = rows < T
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h * stride_oh + rows[:, None].to(tl.int64) * stride_ot
                + d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h * stride_doh + rows[:, None].to(tl.int64) * stride_dot
                 + d[None, :], mask=ok[:, None], other=0.0)
    row0 = (off_b * H + off_h).to(tl.int64)
    lse = tl.load(LSE + row0 * T + rows, mask=ok, other=0.0) * 1.4426950408889634
    aux = AUX + row0 * 2 * T_PAD + rows
    tl.store(aux, tl.where(ok, lse, 0.0), mask=rows < T_PAD)
    tl.store(aux + T_PAD, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T_PAD)


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.cache
def _tile_layout(block: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over t with this box (rows past an edge read as zeros, writes past it dropped)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _tile_layout(tuple(block), t.dtype))


class _Address(NamedTuple):
    """A device address where a descriptor wants its base tensor: all a later launch reads of it."""
    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


class _HostDesc(NamedTuple):
    """What triton 3.6's C launcher reads of a host TensorDescriptor (base address, shape, strides,
    padding) and nothing more: the tensor itself is not kept, and none of TensorDescriptor's
    checks run again (the first launch of the layout ran them). Later launches of the forward and
    the backward pass these."""
    base: _Address
    shape: list
    strides: list
    padding: str


def _kept(descriptors) -> tuple:
    """What a bound launch keeps of its first launch's descriptors: all but the base tensor."""
    return tuple((d.shape, d.strides, d.padding) for d in descriptors)


def _rebound(tensors, kept: tuple) -> tuple:
    """The descriptors of a later launch: the kept ones over these tensors' addresses."""
    return tuple(_HostDesc(_Address(t.data_ptr()), *d) for t, d in zip(tensors, kept, strict=True))


def _scratch(q, block_m: int, warmup: bool) -> tuple:
    """The backward's buffers: aux (B, H, 2, T_pad) fp32, and dQ's fp32 accumulator with the
    order counters, zeroed by one fill. The accumulator is (B, H, T, D) in (B, T, H, D) memory
    order, as kernels/flash_attn.py lays out dq: the final scaling pass then reads and writes
    both in the same order, vectorized (strided, it took twice as long)."""
    B, H, T, D = q.shape
    device = "cpu" if warmup else q.device
    aux = torch.empty((B, H, 2, triton.cdiv(T, 4) * 4), dtype=torch.float32, device=device)  # 16-byte rows (TMA)
    n_acc, m_blocks = B * H * T * D, triton.cdiv(T, block_m)
    zeroed = torch.zeros(n_acc + B * H * m_blocks, dtype=torch.float32, device=device)
    dq_acc = zeroed[:n_acc].view(B, T, H, D).transpose(1, 2)
    return aux, dq_acc, zeroed[n_acc:].view(torch.int32).view(B, H, m_blocks)


def _launch(do, q, k, v, o, lse, dk, dv, row_hi: torch.Tensor | None, causal: bool, scale: float,
            deterministic: bool = True,
            blocks: tuple[int, int, int] | None = None, warmup: bool = False):
    """Launches the backward (its aux pass first) through Triton's front door; returns the fp32 dQ
    accumulator, unscaled, and what later launches of this layout need (or, with warmup, only
    compiles the backward kernel and returns it). row_hi: as backward's, or None."""
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    BLOCK_M, BLOCK_N, STAGES = blocks or BLOCKS[D]
    aux, dq_acc, sem = _scratch(q, BLOCK_M, warmup)
    t_pad = aux.shape[3]
    aux_grid = (triton.cdiv(t_pad, 64), H, B)
    aux_tail = (*o.stride()[:3], *do.stride()[:3], H, T, t_pad, D, 64)  # ..., HEAD_DIM, BLOCK
    if not warmup:
        aux_compiled = _aux_kernel[aux_grid](o, do, lse, aux, *aux_tail)
    bounded = row_hi is not None
    row_hi = lse if row_hi is None else row_hi  # lse stands in for absent bounds: unread
    args = (_descriptor(q, [1, 1, BLOCK_M, D]), _descriptor(k, [1, 1, BLOCK_N, D]), _descriptor(v, [1, 1, BLOCK_N, D]),
            _descriptor(do, [1, 1, BLOCK_M, D]), _descriptor(aux, [1, 1, 1, BLOCK_M]),
            _descriptor(dq_acc, [1, 1, BLOCK_M, D]), sem, row_hi, dk, dv, *dk.stride()[:3],
            *dv.stride()[:3], H, H // H_kv, T, S, scale, scale * _LOG2E.value)
    # registers: the two 1-warp workers share one warpgroup at WORKER_REGS; the matmul warps get
    # what is left of 64K over 3 warpgroups (240 each)
    meta = dict(CAUSAL=causal, BOUNDED=bounded, DETERMINISTIC=deterministic, BLOCK_M=BLOCK_M, STAGES=STAGES,
                WORKER_REGS=24,
                num_warps=NUM_WARPS, maxnreg=65536 // ((NUM_WARPS + 4) * 32) // 8 * 8)
    grid = (triton.cdiv(S, BLOCK_N), H_kv, B)
    if warmup:
        return _bwd_kernel.warmup(*args, grid=grid, **meta)
    compiled = _bwd_kernel[grid](*args, **meta)
    descs = _kept(args[:6])
    tail = (*args[10:], *(meta[name] for name in _bwd_kernel.arg_names[len(args):]))
    return dq_acc, (aux_compiled, aux_grid, aux_tail, compiled, grid, descs, tail)


# the compiled aux and backward kernels per input layout, with what their launches fix (as _FWD_BOUND)
_BWD_BOUND: dict[tuple, tuple] = {}


def backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, row_hi: torch.Tensor | None = None,
             deterministic: bool = True, blocks: tuple[int, int, int] | None = None) -> None:
    """Writes dq, dk, dv (shaped like q, k, v; head dim contiguous) from the forward's o and lse
    ((B, H, T) fp32, contiguous). row_hi: None, or (B, S) int32 contiguous (causal only), one past
    the last query that sees each key, to attend within documents or a window (kernels/flash_attn.py's
    Bounds.row_hi). deterministic: dQ's shares added in a fixed order (the
    same bits every run), or in the order they come (not). blocks overrides BLOCKS (benchmarks)."""
    # the aux kernel is compiled for o, do and lse as aligned (or not) as the first call's
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), o.stride(), dk.stride(), dv.stride(),
              q.dtype, q.device.index, causal, row_hi is None, deterministic, scale, blocks,
              *(t.data_ptr() % 16 == 0 for t in (o, do, lse, lse if row_hi is None else row_hi)))
    if bound := _BWD_BOUND.get(layout):
        aux_compiled, aux_grid, aux_tail, compiled, grid, descs, tail = bound
        aux, dq_acc, sem = _scratch(q, (blocks or BLOCKS[q.shape[3]])[0], False)
        device = q.device.index
        launch_compiled(aux_compiled, aux_grid, device, (o, do, lse, aux, *aux_tail))
        launch_compiled(compiled, grid, device, (*_rebound((q, k, v, do, aux, dq_acc), descs), sem,
                                                 lse if row_hi is None else row_hi, dk, dv,
                                                 *tail))
    else:
        dq_acc, _BWD_BOUND[layout] = _launch(do, q, k, v, o, lse, dk, dv, row_hi, causal, scale, deterministic, blocks)
    torch.mul(dq_acc, scale, out=dq)  # rows that see no key (causal, T > S) got no share: zero


def compile_only(do, q, k, v, causal: bool, bounded: bool = False):
    """The compiled kernel for these inputs' layout, without launching it (kernels/sm90.py)."""
    B, H, T, _ = q.shape
    lse = torch.empty((B, H, T), dtype=torch.float32)
    row_hi = torch.empty((B, k.shape[2]), dtype=torch.int32) if bounded else None
    return _launch(do, q, k, v, torch.empty_like(q), lse, torch.empty_like(k), torch.empty_like(v),
                   row_hi, causal, q.shape[3] ** -0.5, warmup=True)


# --------------------------------------------------------------------------------------------
# forward: warp-specialized. A program owns CONSUMERS * 64 query rows of one head. One warp
# (the producer) streams the K/V blocks by TMA into a STAGES-deep ring; each consumer warpgroup
# owns 64 of the rows and runs the online softmax over every block:
#
#     S = Q K_j^T                  (64, BLOCK_N)  wgmma, Q and K from shared memory
#     m = max(m, rowmax(S) * scale * log2(e)); P = exp2(S * scale * log2(e) - m)
#     O = O * exp2(m_old - m) + P V_j              P straight from registers as the A operand
#
# and frees the slot for the producer when its matmuls are done. The consumers share nothing but
# the ring, so while one waits on its matmuls the other's exp2s run (the warp schedulers
# interleave them): the overlap FlashAttention-3 gets from its second warpgroup, without a
# hand-written schedule. Q arrives by TMA once; O leaves by TMA through Q's buffer.

FWD_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
PRODUCER_REGS = gl.constexpr(24)  # the producer only issues TMA copies and waits on barriers


@gluon.jit
def _fwd_step(i, j, acc, l_i, m_i, q_t, k_smem, v_smem, k_ready, v_ready, kv_empty, rows, cols, key_lo, T, S,
              qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """Key block j (ring slot i) of the online softmax; frees the slot when its matmuls are done."""
    ROWS: gl.constexpr = q_t.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    stage = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    qk = warpgroup_mma(q_t, k_smem.index(stage).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                       use_acc=False)
    if MASKED:
        keys = j * BLOCK_N + cols
        visible = keys[None, :] < S
        if CAUSAL:  # bottom-right: query i sees key j iff j <= i + S - T
            visible = visible & (keys[None, :] <= rows[:, None] + (S - T))
        if BOUNDED:  # and only keys from its first on (a document's start, the window's)
            visible = visible & (keys[None, :] >= key_lo[:, None])
        qk = gl.where(visible, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_sub = m_new
    if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(stage), phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(q_t.dtype), p_layout), v_smem.index(stage), acc)
    mbarrier.arrive(kv_empty.index(stage), count=1)
    return acc, l_i, m_new


@gluon.jit
def _fwd_pass(i, k_ready, v_ready, kv_empty, STAGES: gl.constexpr):
    """Ring slot i holds a key block this warpgroup's rows do not see (below their first keys, where
    another warpgroup's rows see it): free it once loaded, unread. Waiting for the load keeps this
    warpgroup from freeing a slot twice before the other has freed it once."""
    stage = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.wait(v_ready.index(stage), phase)
    mbarrier.arrive(kv_empty.index(stage), count=1)


@gluon.jit
def _fwd_consume(descs, smem, bars, coords, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, C: gl.constexpr):
    """Consumer warpgroup C: query rows start_m + 64 C .. + 63 against the program's key blocks."""
    q_desc, k_desc, v_desc, o_desc, LSE = descs
    q_smem, k_smem, v_smem = smem
    q_bar, k_ready, v_ready, kv_empty = bars
    off_b, off_h, off_hkv, start_m, lo, n_blocks, KEY_LO, H, T, S, qk_scale = coords
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    first = start_m + C * ROWS
    rows = first + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    # the program's key blocks lo .. n_blocks - 1 pass through the ring in order; this warpgroup
    # passes those before own_lo unread, masks those before full_lo, needs no mask on those before
    # n_full (all keys < S, and (causal) none after its first row) and masks the rest
    n_full = S // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(n_full, gl.maximum(first + S - T + 1, 0) // BLOCK_N)
    n_full = gl.minimum(n_full, n_blocks)
    own_lo = lo
    full_lo = lo
    key_lo = rows
    if BOUNDED:  # from the tile of its first row's first key; mask-free past its last row's (key_lo grows)
        key_lo = gl.load(KEY_LO + rows, mask=rows < T, other=0)
        first_lo = gl.load(KEY_LO + gl.minimum(first, T - 1))
        last_lo = gl.load(KEY_LO + gl.minimum(first + ROWS, T) - 1)
        own_lo = gl.where(first < T, first_lo // BLOCK_N, n_blocks)  # rows past T: no block
        full_lo = gl.where(first < T, gl.cdiv(last_lo, BLOCK_N), n_full)
    q_t = q_smem.index(C)
    mbarrier.wait(q_bar.index(C), 0)
    for j in range(lo, own_lo):
        _fwd_pass(j - lo, k_ready, v_ready, kv_empty, STAGES)
    for j in range(own_lo, gl.minimum(full_lo, n_full)):
        acc, l_i, m_i = _fwd_step(j - lo, j, acc, l_i, m_i, q_t, k_smem, v_smem, k_ready, v_ready, kv_empty, rows,
                                  cols, key_lo, T, S, qk_scale, True, CAUSAL, BOUNDED)
    for j in range(full_lo, n_full):
        acc, l_i, m_i = _fwd_step(j - lo, j, acc, l_i, m_i, q_t, k_smem, v_smem, k_ready, v_ready, kv_empty, rows,
                                  cols, key_lo, T, S, qk_scale, False, CAUSAL, BOUNDED)
    for j in range(gl.maximum(own_lo, n_full), n_blocks):
        acc, l_i, m_i = _fwd_step(j - lo, j, acc, l_i, m_i, q_t, k_smem, v_smem, k_ready, v_ready, kv_empty, rows,
                                  cols, key_lo, T, S, qk_scale, True, CAUSAL, BOUNDED)

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # rows that attend no key: O = 0, LSE = -inf
    lse = (m_i + gl.log2(l_safe)) / _LOG2E
    gl.store(LSE + (off_b * H + off_h).to(gl.int64) * T + rows, lse, mask=rows < T)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    q_t.store(o.to(q_t.dtype))  # Q's buffer is free: this warpgroup's matmuls are all done
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [off_b, off_h, first, 0], q_t.reshape([1, 1, ROWS, HEAD_DIM]))
    tma.store_wait(0)


@gluon.jit
def _fwd_consume_1(descs, smem, bars, coords, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    _fwd_consume(descs, smem, bars, coords, CAUSAL, BOUNDED, 1)


@gluon.jit
def _fwd_consume_2(descs, smem, bars, coords, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    _fwd_consume(descs, smem, bars, coords, CAUSAL, BOUNDED, 2)


@gluon.jit
def _fwd_produce(descs, smem, bars, coords, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """The producer warp: each consumer's Q tile, then the K/V blocks lo .. n_blocks - 1 through the ring."""
    q_desc, k_desc, v_desc, o_desc, LSE = descs
    q_smem, k_smem, v_smem = smem
    q_bar, k_ready, v_ready, kv_empty = bars
    off_b, off_h, off_hkv, start_m, lo, n_blocks, KEY_LO, H, T, S, qk_scale = coords
    CONSUMERS: gl.constexpr = q_smem.type.shape[0]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, start_m + c * ROWS, 0], q_bar.index(c),
                                        q_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]))
    for j in range(lo, n_blocks):
        stage = (j - lo) % STAGES
        mbarrier.wait(kv_empty.index(stage), (((j - lo) // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, j * BLOCK_N, 0], k_ready.index(stage),
                                        k_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, j * BLOCK_N, 0], v_ready.index(stage),
                                        v_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]))


@gluon.jit
def _fwd_kernel(
    q_desc, k_desc, v_desc,  # TMA descriptors of (B, H, T, D), (B, H_kv, S, D) x2
    o_desc,  # of (B, H, T, D): the output
    LSE,  # (B, H, T) fp32, natural log
    KEY_LO,  # (B, T) int32: each query's first key (BOUNDED only: documents, a window)
    H, GROUP, T, S,
    qk_scale,  # softmax_scale * log2(e)
    CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    # the longest causal rows start first, so that short ones fill the tail of the launch
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * (CONSUMERS * ROWS)
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    key_end = S
    if CAUSAL:  # one past the last key the program's last row sees (<= 0: its rows see none)
        key_end = gl.minimum(S, start_m + CONSUMERS * ROWS + S - T)
    n_blocks = gl.cdiv(gl.maximum(key_end, 0), BLOCK_N)
    key_lo = KEY_LO + off_b.to(gl.int64) * T
    lo = 0  # bounded, keys before the first row's first key are never loaded
    if BOUNDED:
        lo = gl.load(key_lo + start_m) // BLOCK_N

    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_tile)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_tile)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_tile)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # every consumer frees the slot

    descs = (q_desc, k_desc, v_desc, o_desc, LSE)
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bar, k_ready, v_ready, kv_empty)
    coords = (off_b, off_h, off_h // GROUP, start_m, lo, n_blocks, key_lo, H, T, S, qk_scale)
    if CONSUMERS == 2:
        gl.warp_specialize([(_fwd_consume, (descs, smem, bars, coords, CAUSAL, BOUNDED, 0)),
                            (_fwd_consume_1, (descs, smem, bars, coords, CAUSAL, BOUNDED)),
                            (_fwd_produce, (descs, smem, bars, coords, CAUSAL, BOUNDED))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_fwd_consume, (descs, smem, bars, coords, CAUSAL, BOUNDED, 0)),
                            (_fwd_consume_1, (descs, smem, bars, coords, CAUSAL, BOUNDED)),
                            (_fwd_consume_2, (descs, smem, bars, coords, CAUSAL, BOUNDED)),
                            (_fwd_produce, (descs, smem, bars, coords, CAUSAL, BOUNDED))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def fwd_blocks(head_dim: int, seq_len: int) -> tuple[int, int, int]:
    """(consumer warpgroups, BLOCK_N, STAGES) for this head dim and query length: measured best on
    the H100 (docs/perf-notes.md v11). At D = 64 a third consumer pays once rows are many enough
    that its 64 extra masked rows per program do not."""
    if head_dim == 64:
        return (3, 128, 3) if seq_len >= 2048 else (2, 128, 3)
    return 2, 128, 2


def _fwd_meta(causal: bool, bounded: bool, blocks: tuple[int, int, int]) -> dict:
    consumers, _, stages = blocks
    # registers are shared out per warpgroup, 64K in all: the producer's warp takes a warpgroup
    # slot at PRODUCER_REGS; the consumers split the rest, the default partition (consumer 0)
    # getting what maxnreg leaves it
    maxnreg = 65536 // ((consumers + 1) * 128) // 8 * 8
    consumer_regs = (65536 // 128 - PRODUCER_REGS.value) // consumers // 8 * 8
    return dict(CAUSAL=causal, BOUNDED=bounded, CONSUMERS=consumers, STAGES=stages, CONSUMER_REGS=consumer_regs,
                num_warps=4, maxnreg=maxnreg)


def _fwd_grid(q, blocks: tuple[int, int, int]) -> tuple[int, int, int]:
    B, H, T, _ = q.shape
    return triton.cdiv(T, blocks[0] * FWD_ROWS), H, B


def _fwd_args(q, k, v, o, lse, key_lo, scale: float, block_n: int) -> tuple:
    (_, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    return (_descriptor(q, [1, 1, FWD_ROWS, D]), _descriptor(k, [1, 1, block_n, D]), _descriptor(v, [1, 1, block_n, D]),
            _descriptor(o, [1, 1, FWD_ROWS, D]), lse, key_lo, H, H // H_kv, T, S, scale * _LOG2E.value)


# the compiled forward per input layout, with its grid, its four descriptors' shapes and strides
# and its arguments after LSE: later calls launch it directly (kernels/launch.py) with descriptors
# rebuilt from the new addresses, where Triton's front door would bind every argument again and
# TensorDescriptor would re-check what the layout already fixes (52 us per call against 41 on the
# H100 machine's host, perf-notes v12)
_FWD_BOUND: dict[tuple, tuple] = {}


def forward(q, k, v, o, lse, causal: bool, scale: float, key_lo: torch.Tensor | None = None,
            blocks: tuple[int, int, int] | None = None) -> None:
    """Writes o (shaped like q, head dim contiguous) and lse ((B, H, T) fp32, contiguous, natural
    log). key_lo ((B, T) int32, contiguous; causal only): each query's first key, to attend within
    documents or a window (kernels/flash_attn.py's Bounds.key_lo). blocks overrides
    fwd_blocks (benchmarks)."""
    bounded = key_lo is not None
    key_lo = lse if key_lo is None else key_lo  # lse stands in for absent bounds: unread
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), o.stride(), q.dtype, q.device.index, causal,
              bounded, scale, blocks, lse.data_ptr() % 16 == 0, key_lo.data_ptr() % 16 == 0)
    if bound := _FWD_BOUND.get(layout):
        compiled, grid, descs, tail = bound
        launch_compiled(compiled, grid, q.device.index, (*_rebound((q, k, v, o), descs), lse, key_lo, *tail))
        return
    blocks = blocks or fwd_blocks(q.shape[3], q.shape[2])
    args = _fwd_args(q, k, v, o, lse, key_lo, scale, blocks[1])
    grid = _fwd_grid(q, blocks)
    meta = _fwd_meta(causal, bounded, blocks)
    compiled = _fwd_kernel[grid](*args, **meta)
    descs = _kept(args[:4])
    _FWD_BOUND[layout] = compiled, grid, descs, (*args[6:], *(meta[name] for name in _fwd_kernel.arg_names[len(args):]))


def compile_only_forward(q, k, v, causal: bool, bounded: bool = False, blocks: tuple[int, int, int] | None = None):
    """The compiled forward kernel for these inputs' layout, without launching it (kernels/sm90.py)."""
    (B, H, T, D) = q.shape
    blocks = blocks or fwd_blocks(D, T)
    args = _fwd_args(q, k, v, torch.empty_like(q), torch.empty((B, H, T), dtype=torch.float32),
                     torch.empty((B, T), dtype=torch.int32), D ** -0.5, blocks[1])
    return _fwd_kernel.warmup(*args, grid=_fwd_grid(q, blocks), **_fwd_meta(causal, bounded, blocks))
