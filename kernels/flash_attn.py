"""FlashAttention-2 forward and backward in Triton (Dao, "FlashAttention-2", 2023).

Forward: one program per (query block, head, batch) keeps its Q tile and fp32 accumulators on
chip and streams K/V tiles through an online softmax (running row max m and sum l, one rescale
per tile, one division at the end; exp2 with softmax_scale * log2(e) folded into one fma). It
stores LSE = log sum_j exp(scale q.k_j) per row, natural log, fp32 (B, H, T). Backward: delta =
rowsum(dO * O); a dK/dV kernel keeps a K/V tile resident and streams Q/dO tiles; a dQ kernel
keeps a Q/dO tile resident and streams K/V tiles; both recompute P from LSE. Every output
element is written by one program, without atomics: the backward is bit-identical run to run,
at the price of computing QK^T and dO V^T in both kernels (7 matmuls per tile pair, not 5).

Conventions: q is (B, H, T, D), k and v (B, H_kv, S, D), H % H_kv == 0 (GQA: query head h reads
kv head h // (H / H_kv)). causal is bottom-right aligned: query i sees key j iff j <= i + S - T
(SDPA's is_causal for T == S); rows that see no key get O = 0, LSE = -inf, zero gradients. Any
strides, any T and S, D <= 256 (tiles pad D to a power of two >= 16 and mask the rest), fp16,
bf16 and fp32 (fp32 as true IEEE matmuls). O, dQ, dK, dV are (B, T, H, D) in memory, returned
as (B, H, T, D) views, so the caller's transpose back to (B, T, H * D) is free. Causal query
blocks visit only the key blocks left of the diagonal, start longest-first, and mask only the
blocks that straddle the diagonal or the end of the keys.

Packed documents (doc_ids (B, T), T == S): query i attends key j only in its own document. A
sliding window of W keys: query i attends only keys j > i + S - T - W. Both bound each query's
keys from below, by a bound that grows with the query (Bounds): a query block starts at the tile
of its first row's first key, a key block stops at the row past its last key's last query, so
tiles of other documents and outside the window are skipped, not masked; only tiles that cross a
bound or the diagonal are masked. On Hopper and newer GPUs the streamed tiles arrive
through TMA descriptors, built once per program, where the inputs allow (contiguous head dim,
16-byte aligned strides); elsewhere through masked pointer loads, for any strides and sizes.
Differs from Triton's tutorial 06: GQA, any strides, a separate dQ kernel, K not pre-scaled.
CPU tensors run in Triton's interpreter (kernels/interpreter.py), whose bf16 tl.dot is wrong:
there bf16 is computed in fp32 and rounded. kernels/flash_ref.py is the same algorithm in
PyTorch; kernels/launch.py picks block sizes per shape (kernels/tuning.py lists them).
On sm_90, from GLUON_MIN_SEQ queries on, the forward (and the backward at head dim 128) runs
kernels/flash_attn_hopper.py's Gluon kernel where it covers the inputs (FLASH_ATTENTION_BACKEND
below chooses).
"""

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels import tuning
from kernels.launch import Launcher, on_device

MAX_HEAD_DIM = 256
_LOG2E = tl.constexpr(math.log2(math.e))
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_ptrs(base, off_b, off_h, stride_b, stride_h, rows, stride_t, offs_d, stride_d):
    """(len(rows), len(offs_d)) pointers into a (B, H, T, D) tensor. Offsets are int64: one head
    of a fused (T, 3 * H * D) projection passes 2**31 elements at ~0.9M tokens (D = 64, H = 12)."""
    base += off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
    return base + rows.to(tl.int64)[:, None] * stride_t + offs_d[None, :] * stride_d


@triton.jit
def _stream_src(base, off_b, off_h, stride_b, stride_h, n_rows, stride_t, stride_d,
                HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Where _load_tile reads one head's streamed (BLOCK_ROWS, BLOCK_D) tiles of a (B, H, T, D)
    tensor: a TMA descriptor of its (n_rows, HEAD_DIM) matrix (head dim contiguous; reads past
    either end return zeros), or the pointers of the tile at row 0."""
    if TMA:
        base += off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_t, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        return _tile_ptrs(base, off_b, off_h, stride_b, stride_h, tl.arange(0, BLOCK_ROWS), stride_t,
                          tl.arange(0, BLOCK_D), stride_d)


@triton.jit
def _load_tile(src, row, stride_t, ptr_mask, TMA: tl.constexpr):
    """The streamed tile at `row`: through its descriptor (TMA), or row * stride_t (int64, as in
    _tile_ptrs) past the pointers of row 0 under ptr_mask."""
    if TMA:
        return src.load([row, 0])
    else:
        return tl.load(src + tl.cast(row, tl.int64) * stride_t, mask=ptr_mask, other=0.0)


@triton.jit
def _head_dim_mask(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_D,) mask of the real head dims: a constant when D is a power of two >= 16, which
    the compiler drops from the loads."""
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return tl.arange(0, BLOCK_D) < HEAD_DIM


@triton.jit
def _kv_block_range(start_m, T, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query rows [start_m, start_m + BLOCK_M) attend keys [0, end); keys below full_end (a
    multiple of BLOCK_N) are seen by every one of those rows, so need no mask."""
    if CAUSAL:
        full_end = tl.maximum(tl.minimum(start_m + S - T + 1, S), 0) // BLOCK_N * BLOCK_N
        end = tl.maximum(tl.minimum(start_m + BLOCK_M + S - T, S), 0)
    else:
        full_end = S // BLOCK_N * BLOCK_N
        end = S
    return full_end, end


@triton.jit
def _q_block_range(start_n, T, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query rows [start, T) attend keys [start_n, start_n + BLOCK_N); rows from full_start (a
    multiple of BLOCK_M, or T) on see every one of those keys, so need no mask."""
    if CAUSAL:
        start = tl.maximum(start_n - (S - T), 0) // BLOCK_M * BLOCK_M
        first_full_row = tl.maximum(start_n + BLOCK_N - 1 - (S - T), 0)
        full_start = tl.minimum((first_full_row + BLOCK_M - 1) // BLOCK_M * BLOCK_M, T)
    else:
        start = 0
        full_start = 0
    return start, full_start


@triton.jit
def _visible(rows, cols, T, S, key_lo, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):
    """(len(rows), len(cols)) mask of the scores a query row may attend: real keys; under the
    bottom-right causal mask only keys j <= i + S - T; bounded (documents, a window), only keys from
    the row's first one on (key_lo: each row's, from Bounds.key_lo)."""
    visible = cols[None, :] < S
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + (S - T))
    if BOUNDED:
        visible = visible & (cols[None, :] >= key_lo[:, None])
    return visible


@triton.jit
def _bounded_kv_range(KEY_LO, start_m, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bounded, query rows [start_m, start_m + BLOCK_M) attend keys from lo (the tile of the first
    row's first key) on; keys from full_lo on are seen by every row (up to the diagonal): key_lo
    grows with the row, so the last row's decides."""
    lo = tl.load(KEY_LO + start_m) // BLOCK_N * BLOCK_N
    full_lo = tl.cdiv(tl.load(KEY_LO + tl.minimum(start_m + BLOCK_M, T) - 1), BLOCK_N) * BLOCK_N
    return lo, full_lo


@triton.jit
def _bounded_q_range(ROW_HI, start_n, S, full_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bounded, keys [start_n, start_n + BLOCK_N) are attended by query rows before q_hi (the last
    key's row_hi); rows from full_start to full_hi see all of them: row_hi grows with the key, so
    the first key's decides."""
    q_hi = tl.load(ROW_HI + tl.minimum(start_n + BLOCK_N, S) - 1)
    full_hi = tl.maximum(tl.load(ROW_HI + start_n) // BLOCK_M * BLOCK_M, full_start)
    return full_hi, q_hi


@triton.jit
def _kv_ranges(key_lo_ptr, start_m, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(lo, full_lo, full_end, end): the key blocks query rows [start_m, start_m + BLOCK_M) visit, in
    the three runs the forward and dQ kernels walk: masked [lo, min(full_lo, full_end)) where the
    rows' first keys lie (empty unbounded), mask-free [full_lo, full_end), masked
    [max(lo, full_end), end) on the diagonal and past the keys' end."""
    full_end, end = _kv_block_range(start_m, T, S, CAUSAL, BLOCK_M, BLOCK_N)
    if BOUNDED:
        lo, full_lo = _bounded_kv_range(key_lo_ptr, start_m, T, BLOCK_M, BLOCK_N)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_end, end


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running (BLOCK_M, BLOCK_D) output, row sum, row max (log2 units); Q tile
    k_src, v_src,  # TMA descriptors of this kv head's K and V, or the pointers of its (BLOCK_N, BLOCK_D) tile at key 0
    stride_kn, stride_vn,
    rows, offs_n, d_mask, key_lo,
    n_start, n_end, T, S, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    for start_n in range(n_start, n_end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = d_mask[None, :]
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < S)
        k = _load_tile(k_src, start_n, stride_kn, kv_mask, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            qk = tl.where(_visible(rows, cols, T, S, key_lo, CAUSAL, BOUNDED), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(qk, qk_scale, -m_sub[:, None]))  # explicit fma: one op per score
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_src, start_n, stride_vn, kv_mask, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    # pointers
    Q, K, V, O, LSE,
    KEY_LO, ROW_HI,  # Bounds (BOUNDED only): (B, T) each query's first key, (B, S) one past each key's last query
    # strides: batch, head, sequence, head dim
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    # sizes and scale
    H, GROUP, T, S,
    qk_scale,  # softmax_scale * log2(e)
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the longest causal rows start first, so that short ones fill the tail of the launch
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // GROUP

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = _head_dim_mask(HEAD_DIM, BLOCK_D)
    row_mask = (rows[:, None] < T) & d_mask[None, :]

    q = tl.load(_tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, rows, stride_qt, offs_d, stride_qd),
                mask=row_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    k_src = _stream_src(K, off_b, off_hkv, stride_kb, stride_kh, S, stride_kn, stride_kd, HEAD_DIM, BLOCK_N,
                        BLOCK_D, TMA)
    v_src = _stream_src(V, off_b, off_hkv, stride_vb, stride_vh, S, stride_vn, stride_vd, HEAD_DIM, BLOCK_N,
                        BLOCK_D, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_lo_ptr = KEY_LO + off_b.to(tl.int64) * T
    key_lo = rows
    if BOUNDED:
        key_lo = tl.load(key_lo_ptr + rows, mask=rows < T, other=0)
    lo, full_lo, full_end, end = _kv_ranges(key_lo_ptr, start_m, T, S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
    if BOUNDED:  # masked tiles where the rows' first keys lie, mask-free ones, masked ones at the diagonal
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                                   key_lo, lo, tl.minimum(full_lo, full_end), T, S, qk_scale,
                                   True, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                               key_lo, full_lo, full_end, T, S, qk_scale,
                               False, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                               key_lo, tl.maximum(lo, full_end), end, T, S, qk_scale,
                               True, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that attend no key: O = 0, LSE = -inf
    o = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) / _LOG2E
    tl.store(_tile_ptrs(O, off_b, off_h, stride_ob, stride_oh, rows, stride_ot, offs_d, stride_od),
             o.to(O.dtype.element_ty), mask=row_mask)
    tl.store(LSE + (off_b * H + off_h).to(tl.int64) * T + rows, lse, mask=rows < T)


@triton.jit
def _bwd_preprocess_kernel(
    # pointers
    O, DO, DELTA,
    # strides: batch, head, sequence, head dim
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    # sizes
    H, T,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O), (B, H, T) fp32."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & _head_dim_mask(HEAD_DIM, BLOCK_D)[None, :]
    o = tl.load(_tile_ptrs(O, off_b, off_h, stride_ob, stride_oh, rows, stride_ot, offs_d, stride_od),
                mask=mask, other=0.0)
    do = tl.load(_tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, rows, stride_dot, offs_d, stride_dod),
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (off_b * H + off_h).to(tl.int64) * T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,  # (BLOCK_N, BLOCK_D) fp32 accumulators; resident K and V tiles
    q_src, do_src,  # descriptors of one query head's Q and dO, or the pointers of its (BLOCK_M, BLOCK_D) tile at row 0
    lse_ptr, delta_ptr,  # LSE and delta of that head's row 0
    stride_qt, stride_dot,
    offs_m, cols, d_mask, row_hi,
    m_start, m_end, T, S, qk_scale,
    MASKED: tl.constexpr, BOUNDED: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    TMA: tl.constexpr,
):
    # masked runs exist only under a causal mask (bounds need one too), so MASKED applies it
    for start_m in range(m_start, m_end, BLOCK_M):
        rows = start_m + offs_m
        # rows past T load as zeros with LSE = delta = 0: their P is 1, but dO = 0, so they add 0
        q_mask = (rows[:, None] < T) & d_mask[None, :]
        q = _load_tile(q_src, start_m, stride_qt, q_mask, TMA)
        do = _load_tile(do_src, start_m, stride_dot, q_mask, TMA)
        lse = tl.load(lse_ptr + rows, mask=rows < T, other=0.0) * _LOG2E
        delta = tl.load(delta_ptr + rows, mask=rows < T, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(tl.fma(qk_t, qk_scale, -lse[None, :]))
        if MASKED:  # selected after exp2: a row with LSE = -inf gives inf here and is dropped, never NaN
            visible_t = cols[:, None] <= rows[None, :] + (S - T)
            if BOUNDED:  # a row at or after the key (causal) sees it iff before its row_hi
                visible_t = visible_t & (rows[None, :] < row_hi[:, None])
            p_t = tl.where(visible_t, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    # pointers
    Q, K, V, DO, LSE, DELTA, DK, DV,
    KEY_LO, ROW_HI,  # Bounds, as in the forward
    # strides: batch, head, sequence, head dim
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    # sizes and scales
    H, GROUP, T, S,
    sm_scale, qk_scale,  # softmax_scale, and softmax_scale * log2(e)
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)

    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = _head_dim_mask(HEAD_DIM, BLOCK_D)
    kv_mask = (cols[:, None] < S) & d_mask[None, :]
    # keys past S load as zeros; their dK/dV rows are computed but never stored
    k = tl.load(_tile_ptrs(K, off_b, off_hkv, stride_kb, stride_kh, cols, stride_kn, offs_d, stride_kd),
                mask=kv_mask, other=0.0)
    v = tl.load(_tile_ptrs(V, off_b, off_hkv, stride_vb, stride_vh, cols, stride_vn, offs_d, stride_vd),
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    m_start, full_start = _q_block_range(start_n, T, S, CAUSAL, BLOCK_M, BLOCK_N)
    row_hi = cols
    full_hi = T
    q_hi = T
    if BOUNDED:  # rows from the last key's row_hi on see none of the keys
        row_hi_ptr = ROW_HI + off_b.to(tl.int64) * S
        row_hi = tl.load(row_hi_ptr + cols, mask=cols < S, other=0)
        full_hi, q_hi = _bounded_q_range(row_hi_ptr, start_n, S, full_start, BLOCK_M, BLOCK_N)
    for g in range(GROUP):  # GQA: the kv head's query heads, summed in a fixed order
        off_h = off_hkv * GROUP + g
        q_src = _stream_src(Q, off_b, off_h, stride_qb, stride_qh, T, stride_qt, stride_qd, HEAD_DIM, BLOCK_M, BLOCK_D,
                            TMA)
        do_src = _stream_src(DO, off_b, off_h, stride_dob, stride_doh, T, stride_dot, stride_dod, HEAD_DIM, BLOCK_M,
                             BLOCK_D, TMA)
        row0 = (off_b * H + off_h).to(tl.int64) * T
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + row0, DELTA + row0, stride_qt, stride_dot,
                                 offs_m, cols, d_mask, row_hi, m_start, tl.minimum(full_start, q_hi), T, S, qk_scale,
                                 True, BOUNDED, INPUT_PRECISION, BLOCK_M, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + row0, DELTA + row0, stride_qt, stride_dot,
                                 offs_m, cols, d_mask, row_hi, full_start, full_hi, T, S, qk_scale,
                                 False, BOUNDED, INPUT_PRECISION, BLOCK_M, TMA)
        if BOUNDED:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + row0, DELTA + row0, stride_qt,
                                     stride_dot, offs_m, cols, d_mask, row_hi, full_hi, q_hi, T, S,
                                     qk_scale, True, BOUNDED, INPUT_PRECISION, BLOCK_M, TMA)

    dk *= sm_scale  # dS is the gradient of the scaled scores: dK = scale * dS^T Q
    tl.store(_tile_ptrs(DK, off_b, off_hkv, stride_dkb, stride_dkh, cols, stride_dkn, offs_d, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(_tile_ptrs(DV, off_b, off_hkv, stride_dvb, stride_dvh, cols, stride_dvn, offs_d, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta,  # (BLOCK_M, BLOCK_D) fp32 accumulator; resident Q, dO; LSE (log2 units), delta
    k_src, v_src,  # as in _fwd_inner
    stride_kn, stride_vn,
    rows, offs_n, d_mask, key_lo,
    n_start, n_end, T, S, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    for start_n in range(n_start, n_end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = d_mask[None, :]
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < S)
        k = _load_tile(k_src, start_n, stride_kn, kv_mask, TMA)
        v = _load_tile(v_src, start_n, stride_vn, kv_mask, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(tl.fma(qk, qk_scale, -lse[:, None]))
        if MASKED:  # selected after exp2, as in the dK/dV kernel
            p = tl.where(_visible(rows, cols, T, S, key_lo, CAUSAL, BOUNDED), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    # pointers
    Q, K, V, DO, LSE, DELTA, DQ,
    KEY_LO, ROW_HI,  # Bounds, as in the forward
    # strides: batch, head, sequence, head dim
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    # sizes and scales
    H, GROUP, T, S,
    sm_scale, qk_scale,  # softmax_scale, and softmax_scale * log2(e)
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # longest rows first
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // GROUP

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = _head_dim_mask(HEAD_DIM, BLOCK_D)
    row_mask = (rows[:, None] < T) & d_mask[None, :]

    q = tl.load(_tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, rows, stride_qt, offs_d, stride_qd),
                mask=row_mask, other=0.0)
    do = tl.load(_tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, rows, stride_dot, offs_d, stride_dod),
                 mask=row_mask, other=0.0)
    row0 = (off_b * H + off_h).to(tl.int64) * T
    lse = tl.load(LSE + row0 + rows, mask=rows < T, other=0.0) * _LOG2E
    delta = tl.load(DELTA + row0 + rows, mask=rows < T, other=0.0)
    k_src = _stream_src(K, off_b, off_hkv, stride_kb, stride_kh, S, stride_kn, stride_kd, HEAD_DIM, BLOCK_N,
                        BLOCK_D, TMA)
    v_src = _stream_src(V, off_b, off_hkv, stride_vb, stride_vh, S, stride_vn, stride_vd, HEAD_DIM, BLOCK_N,
                        BLOCK_D, TMA)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_lo_ptr = KEY_LO + off_b.to(tl.int64) * T
    key_lo = rows
    if BOUNDED:
        key_lo = tl.load(key_lo_ptr + rows, mask=rows < T, other=0)
    lo, full_lo, full_end, end = _kv_ranges(key_lo_ptr, start_m, T, S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
    if BOUNDED:  # the forward's three runs
        dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                           key_lo, lo, tl.minimum(full_lo, full_end), T, S, qk_scale,
                           True, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                       key_lo, full_lo, full_end, T, S, qk_scale,
                       False, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, rows, offs_n, d_mask,
                       key_lo, tl.maximum(lo, full_end), end, T, S, qk_scale,
                       True, CAUSAL, BOUNDED, INPUT_PRECISION, BLOCK_N, TMA)

    dq *= sm_scale
    tl.store(_tile_ptrs(DQ, off_b, off_h, stride_dqb, stride_dqh, rows, stride_dqt, offs_d, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# launchers

_FWD = Launcher(_fwd_kernel, tuning.FWD, tuning.CPU_FWD, tuning.FWD_PRUNE)
_DQ = Launcher(_bwd_dq_kernel, tuning.DQ, tuning.CPU_DQ, tuning.DQ_PRUNE)
_DKDV = Launcher(_bwd_dkdv_kernel, tuning.DKDV, tuning.CPU_DKDV, tuning.DKDV_PRUNE)
_PREPROCESS = Launcher(_bwd_preprocess_kernel, [triton.Config({"BLOCK_M": 64})], triton.Config({"BLOCK_M": 64}))
# the tuned kernels by name, for the tests and scripts/tune_attention.py to pin configs
LAUNCHERS = {"fwd": _FWD, "dq": _DQ, "dkdv": _DKDV}


def _check_inputs(q, k, v):
    """Raise ValueError, saying what is supported, for inputs the kernels do not handle."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"a {t.dim()}-D tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flash_attention: {name} must be a 4-D tensor (batch, heads, seq_len, head_dim), "
                             f"got {got}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} is not supported: use torch.float16, torch.bfloat16 "
                         "or torch.float32")
    if not q.device == k.device == v.device:
        raise ValueError(f"flash_attention: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: device {q.device} is not supported: use a CUDA device "
                         "(or the CPU, through Triton's interpreter)")
    (B, H, T, D), (B_kv, H_kv, S, D_kv) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if B_kv != B or D_kv != D:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch size "
                         "and head_dim (shapes are (batch, heads, seq_len, head_dim))")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"flash_attention: q's {H} heads must be a multiple of k and v's {H_kv} heads "
                         "(grouped-query attention)")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim {D} is not supported: head_dim must be at most {MAX_HEAD_DIM}")
    if 0 in (B, H, T, S, D):
        raise ValueError(f"flash_attention: empty input q {tuple(q.shape)}, k {tuple(k.shape)}: "
                         "every dimension must be at least 1")


def _empty_bhtd(B, H, T, D, like):
    """A (B, H, T, D) tensor laid out in (B, T, H, D) memory order."""
    return torch.empty_strided((B, H, T, D), (T * H * D, D, H * D, 1), dtype=like.dtype, device=like.device)


def _interpreted_bf16(q):
    """bf16 inputs that Triton's interpreter would run: its bf16 tl.dot is wrong."""
    return q.dtype == torch.bfloat16 and (q.device.type == "cpu" or isinstance(_fwd_kernel, InterpretedFunction))


def _meta(q, k, causal, bnd, tma):
    """(tuning key, constexprs) of a call: a new sequence length retunes only past a power of two.
    Raises ValueError where the GPU cannot run the dtype (looked up here, where torch.compile does
    not trace: inside the launchers, once per input signature)."""
    if q.is_cuda and (why := _bf16_missing(q.dtype, tuning.chip(q.device.index))):
        raise ValueError(f"flash_attention: {why}: use torch.float16")
    D, T, S = q.shape[3], q.shape[2], k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    bounded = bnd is not None
    key = (q.device.index, q.dtype, block_d, causal, bounded, tma, triton.next_power_of_2(T),
           triton.next_power_of_2(S))
    # the precision of fp32 inputs' dots ("ieee": true fp32); irrelevant for fp16/bf16, whose dots
    # are named tf32 only where the GPU has it (Ampere on)
    tf32 = q.dtype != torch.float32 and (not q.is_cuda or tuning.chip(q.device.index).tf32)
    constexprs = {"HEAD_DIM": D, "BLOCK_D": block_d, "CAUSAL": causal, "BOUNDED": bounded,
                  "INPUT_PRECISION": "tf32" if tf32 else "ieee", "TMA": tma}
    return key, constexprs


def _tma(*streamed: torch.Tensor) -> bool:
    """Whether the kernels read these streamed (B, H, T, D) inputs through TMA descriptors: compiled
    for an NVIDIA Hopper or newer GPU, with the head dim contiguous, rows that do not overlap (an
    expanded gradient's stride 0 does), and the base and every other stride 16-byte aligned (TMA's
    requirements); FLASH_ATTENTION_TMA=0 turns it off (for comparison)."""
    t = streamed[0]
    if not t.is_cuda or isinstance(_fwd_kernel, InterpretedFunction) or not tuning.chip(t.device.index).tma:
        return False
    if os.environ.get("FLASH_ATTENTION_TMA", "1") == "0":
        return False
    return all(x.stride(3) == 1 and x.stride(2) >= x.shape[3] and x.data_ptr() % 16 == 0
               and all(s * x.element_size() % 16 == 0 for s in x.stride()[:3]) for x in streamed)


def _bf16_missing(dtype: torch.dtype, chip: tuning.Chip) -> str | None:
    """Why the card cannot run bf16 matmuls, if dtype is bf16 and it cannot (None otherwise)."""
    if dtype == torch.bfloat16 and not chip.bf16:
        major, minor = chip.capability
        return f"bfloat16 needs compute capability 8.0 or newer; {chip.name} is {major}.{minor}"
    return None


def unsupported(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernels cannot run head_dim in dtype on this device (None: they can), for a check
    before training: bf16 below compute capability 8.0, or no tile config that fits the card."""
    if device.type != "cuda":
        return None
    chip = tuning.chip(torch.cuda.current_device() if device.index is None else device.index)
    if why := _bf16_missing(dtype, chip):
        return why
    try:
        for launcher in LAUNCHERS.values():
            launcher.candidates({"BLOCK_D": max(16, triton.next_power_of_2(head_dim))}, dtype.itemsize, chip)
    except tuning.NoConfigFits as e:
        return str(e).removeprefix("flash_attention: ")
    return None


def softmax_scale_of(q, softmax_scale=None) -> float:
    """The scale of the scores: softmax_scale, or 1 / sqrt(head_dim) when it is None."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


class Bounds(NamedTuple):
    """The band of keys each query sees inside the causal mask, as the kernels read it: key_lo (B, T)
    int32, every query's first key; row_hi (B, S) int32, one past every key's last query. Packed
    documents and a sliding window each bound the band from below, and both grow with the index,
    so one comparison per score masks both, and whole tiles outside the band are skipped."""
    key_lo: torch.Tensor
    row_hi: torch.Tensor


def bounds(doc_ids: torch.Tensor | None, window: int, B: int, T: int, S: int, device: torch.device) -> Bounds | None:
    """The Bounds of packed documents doc_ids (B, T) (a document is a run of equal ids, so any ids,
    repeated further on or colliding in int32, mask as they skip) and of a causal window of W keys
    (query i, at key position i + S - T, sees keys i + S - T - W + 1 .. i + S - T; 0: no window),
    or None where neither bounds anything."""
    if window >= S:  # the window holds every key a query may see
        window = 0
    if doc_ids is None and window == 0:
        return None
    rows = torch.arange(T, dtype=torch.int32, device=device).expand(B, T)
    keys = torch.arange(S, dtype=torch.int32, device=device).expand(B, S)
    key_lo, row_hi = torch.zeros_like(rows), torch.full_like(keys, T)
    if doc_ids is not None:  # T == S
        first = torch.ones_like(doc_ids, dtype=torch.bool)
        first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        last = torch.ones_like(first)
        last[:, :-1] = first[:, 1:]
        key_lo = torch.cummax(torch.where(first, rows, 0), dim=1).values
        row_hi = torch.cummin(torch.where(last, rows + 1, T).flip(1), dim=1).values.flip(1)
    if window:
        key_lo = torch.maximum(key_lo, rows + (S - T - window + 1))
        row_hi = torch.minimum(row_hi, keys + (window + T - S))
    return Bounds(key_lo.clamp(0, S).contiguous(), row_hi.clamp(0, T).contiguous())


_WINDOWS: dict[tuple, Bounds | None] = {}  # (B, T, S, window, device) -> its Bounds, without documents


def _window_bounds(window: int, B: int, T: int, S: int, device: torch.device) -> Bounds | None:
    """bounds(None, window, ...), made once per shape in eager calls (a few launches saved per call)."""
    if torch.compiler.is_compiling():
        return bounds(None, window, B, T, S, device)
    key = (B, T, S, window, device)
    if key not in _WINDOWS:
        if len(_WINDOWS) >= 64:  # shapes change rarely; bound the memory where they do
            _WINDOWS.clear()
        _WINDOWS[key] = bounds(None, window, B, T, S, device)
    return _WINDOWS[key]


def _check_docs(q, k, doc_ids, causal):
    (B, _, T, _), S = q.shape, k.shape[2]
    if not causal:
        raise ValueError("flash_attention: doc_ids needs causal=True (documents are masked within causal attention)")
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.shape != (B, T) or doc_ids.device != q.device:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"flash_attention: doc_ids must be a (batch, seq_len) = ({B}, {T}) tensor on {q.device}, "
                         f"got {got}")
    if S != T or doc_ids.is_floating_point():
        raise ValueError("flash_attention: doc_ids needs self-attention (seq_len of q equal to k's) and integer ids")


def _layout(*tensors: torch.Tensor) -> tuple:
    """What checks and compiled launches depend on in these tensors: shape, strides, dtype, device
    and 16-byte alignment. Calls with equal layouts (and flags) reuse both."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)


_CHECKED: set[tuple] = set()  # the layouts (and causal flags) whose checks passed


def _checked(q, k, v, causal, doc_ids, window) -> Bounds | None:
    """The Bounds of doc_ids and window, once q, k, v, doc_ids and window are known good (ValueError
    otherwise)."""
    tensors = (q, k, v) if doc_ids is None else (q, k, v, doc_ids)
    # traced by torch.compile, tensors have no addresses: checked every time (at trace time only)
    cacheable = not torch.compiler.is_compiling() and all(isinstance(t, torch.Tensor) for t in tensors)
    layout = (causal, window, *_layout(*tensors)) if cacheable else None
    if layout is None or layout not in _CHECKED:
        _check_inputs(q, k, v)
        if doc_ids is not None:
            _check_docs(q, k, doc_ids, causal)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"flash_attention: window={window!r}: must be an int >= 0 (0: no window)")
        if window and not causal:
            raise ValueError("flash_attention: window needs causal=True (each query keeps the `window` keys up to "
                             "its own)")
        if layout is not None:
            _CHECKED.add(layout)
    (B, _, T, _), S = q.shape, k.shape[2]
    if doc_ids is None:
        return _window_bounds(window, B, T, S, q.device)
    return bounds(doc_ids, window, B, T, S, q.device)


# --------------------------------------------------------------------------------------------
# one launcher per direction; flash_attn_forward and flash_attn_backward are them with the checks


def _forward(q, k, v, causal, scale, bnd):
    """(o, lse) of checked inputs."""
    if _interpreted_bf16(q):
        o, lse = _forward(q.float(), k.float(), v.float(), causal, scale, bnd)
        return o.to(torch.bfloat16), lse
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    o = _empty_bhtd(B, H, T, D, q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    tensors = (q, k, v, o, lse, *(bnd or (lse, lse)))  # lse stands in for absent bounds: unread
    # o, lse (and the bounds) are fresh from torch's allocator, 512-byte aligned: q, k, v decide
    signature = (*_layout(q, k, v), causal, scale, bnd is None, os.environ.get("FLASH_ATTENTION_TMA"),
                 os.environ.get(BACKEND_VARIABLE))
    if _gluon_runs("forward", signature, (q, k, v)):
        with on_device(q):
            _hopper().forward(q, k, v, o, lse, causal, scale, None if bnd is None else bnd.key_lo)
        return o, lse
    if bound := _FWD.bound_for(signature):
        bound(*tensors)
        return o, lse
    key, constexprs = _meta(q, k, causal, bnd, _tma(k, v))
    with on_device(q):
        _FWD.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                  (*tensors, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, H // H_kv, T, S,
                   scale * _LOG2E.value), key, **constexprs)
    return o, lse


def _backward(do, q, k, v, o, lse, causal, scale, bnd):
    """(dq, dk, dv) of checked inputs; deterministic (unless FLASH_ATTENTION_DETERMINISTIC=0 and the
    Gluon backward runs)."""
    if _interpreted_bf16(q):
        grads = _backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, scale, bnd)
        return tuple(g.to(torch.bfloat16) for g in grads)
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    dq, dk, dv = _empty_bhtd(B, H, T, D, q), _empty_bhtd(B, H_kv, S, D, k), _empty_bhtd(B, H_kv, S, D, v)
    # the outputs and delta are fresh from torch's allocator (512-byte aligned), shaped by q and k
    signature = (*_layout(q, k, v, do, o, lse), causal, scale, bnd is None, os.environ.get("FLASH_ATTENTION_TMA"),
                 os.environ.get(BACKEND_VARIABLE), os.environ.get(DETERMINISTIC_VARIABLE))
    if _gluon_runs("backward", signature, (q, k, v, do)):
        with on_device(q):
            _hopper().backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale,
                              None if bnd is None else bnd.row_hi, _deterministic())
        return dq, dk, dv
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    ends = bnd or (delta, delta)  # delta stands in for absent bounds: unread
    pre, dkdv, dq_ = (o, do, delta), (q, k, v, do, lse, delta, dk, dv, *ends), (q, k, v, do, lse, delta, dq, *ends)
    launches = [launcher.bound_for(signature) for launcher in (_PREPROCESS, _DKDV, _DQ)]
    if all(launches):
        for launch, tensors in zip(launches, (pre, dkdv, dq_), strict=True):
            launch(*tensors)
        return dq, dk, dv
    key, constexprs = _meta(q, k, causal, bnd, _tma(q, k, v, do))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    sizes = (H, H // H_kv, T, S, scale, scale * _LOG2E.value)
    with on_device(q):
        _PREPROCESS.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                         (*pre, *o.stride(), *do.stride(), H, T), key, HEAD_DIM=D, BLOCK_D=constexprs["BLOCK_D"])
        _DKDV.bind(signature, lambda c: (triton.cdiv(S, c["BLOCK_N"]), H_kv, B),
                   (*dkdv, *strides, *dk.stride(), *dv.stride(), *sizes), key, **constexprs)
        _DQ.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                 (*dq_, *strides, *dq.stride(), *sizes), key, **constexprs)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# which kernels run: on sm_90, the Hopper kernels in Gluon (kernels/flash_attn_hopper.py) where they
# cover the inputs and are the faster; the kernels above everywhere else

# unset: per direction, head dim and length, the faster kernel measured on the H100 (docs/perf-notes.md
# v11-v12): from GLUON_MIN_SEQ queries on, the Gluon forward where it covers the inputs and the
# Gluon backward at head dim 128 (the Triton backward at 64); below it, where host time per call
# decides, the kernels above. triton: the kernels above only. gluon: the Hopper kernels both
# ways, or a ValueError saying why not
BACKEND_VARIABLE = "FLASH_ATTENTION_BACKEND"
GLUON_TRITON = "3.6."  # the triton release whose Gluon the Hopper kernels are written in
_GLUON: dict[tuple, bool] = {}  # (direction, input signature) -> whether the Gluon kernel runs it
GLUON_BACKWARD_HEAD_DIMS = (128,)  # where the Gluon backward is the faster one (unset)
GLUON_MIN_SEQ = 2048  # the query length from which the Gluon kernels are the faster ones (unset)


def gluon_missing(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the Hopper kernels (kernels/flash_attn_hopper.py) cannot run this head dim, dtype and
    device (None: they can, for inputs whose strides suit TMA, with or without documents)."""
    if device.type != "cuda" or isinstance(_fwd_kernel, InterpretedFunction):
        return "they run on CUDA GPUs only (Gluon has no interpreter)"
    chip = tuning.chip(torch.cuda.current_device() if device.index is None else device.index)
    if chip.capability != (9, 0):
        return f"they are built for sm_90 (H100, H200); {chip.name} is sm_{chip.capability[0]}{chip.capability[1]}"
    if not triton.__version__.startswith(GLUON_TRITON):
        return f"they are written in triton {GLUON_TRITON}'s Gluon; this is triton {triton.__version__}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"they take float16 and bfloat16, not {dtype}"
    if head_dim not in (64, 128):
        return f"they take head_dim 64 and 128, not {head_dim}"
    return None


def _hopper():
    """kernels/flash_attn_hopper.py, imported on first use: Gluon's API is triton 3.6's, which other
    triton versions need not have."""
    from kernels import flash_attn_hopper
    return flash_attn_hopper


def _backend() -> str:
    """FLASH_ATTENTION_BACKEND: "" (unset), "triton" or "gluon"; ValueError for a value it cannot take."""
    choice = os.environ.get(BACKEND_VARIABLE, "")
    if choice not in ("", "triton", "gluon"):
        raise ValueError(f"{BACKEND_VARIABLE}={choice}: use triton or gluon (or leave it unset)")
    return choice


# "1" (unset) or "0": whether the Gluon backward adds dQ's shares in a fixed order (the same bits
# every run) or as they come (not reproducible, and no faster: docs/perf-notes.md v13); the Triton
# backward has no atomics to order
DETERMINISTIC_VARIABLE = "FLASH_ATTENTION_DETERMINISTIC"


def _deterministic() -> bool:
    """FLASH_ATTENTION_DETERMINISTIC as a bool; ValueError for a value it cannot take."""
    choice = os.environ.get(DETERMINISTIC_VARIABLE, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{DETERMINISTIC_VARIABLE}={choice}: use 1 (the default: the same gradients every run) or 0")
    return choice == "1"


def _gluon_wanted(direction: str, head_dim: int, seq_len: int) -> bool:
    """Whether the backend choice sends this direction to Gluon where it can run (unset: from
    GLUON_MIN_SEQ queries on, the forward, and the backward at the head dims where it is the faster)."""
    choice = _backend()
    if choice == "" and seq_len >= GLUON_MIN_SEQ:
        return direction == "forward" or head_dim in GLUON_BACKWARD_HEAD_DIMS
    return choice == "gluon"


def _gluon_runs(direction: str, signature: tuple, streamed: tuple) -> bool:
    """Whether the Gluon kernel runs this direction of these inputs (decided once per signature);
    ValueError where FLASH_ATTENTION_BACKEND=gluon asks for it and it cannot."""
    runs = _GLUON.get((direction, signature))
    if runs is None:
        runs = False
        q = streamed[0]
        if _gluon_wanted(direction, q.shape[3], q.shape[2]):
            why = gluon_missing(q.shape[3], q.dtype, q.device)
            if why is None and not _tma(*streamed):
                why = "the inputs need a contiguous head dim and 16-byte aligned strides (TMA)"
            if why is not None and _backend() == "gluon":
                raise ValueError(f"{BACKEND_VARIABLE}=gluon: the Hopper {direction} cannot run these inputs: {why}")
            runs = why is None
        _GLUON[direction, signature] = runs
    return runs


def backends(head_dim: int, dtype: torch.dtype, device: torch.device, seq_len: int) -> dict[str, str]:
    """Which kernels run the forward and the backward of attention with this head dim, dtype,
    device and query length (with or without documents), for inputs laid out as the model lays
    them out (the run info logs it); ValueError for a FLASH_ATTENTION_BACKEND or
    FLASH_ATTENTION_DETERMINISTIC value it cannot take, or gluon where it cannot run."""
    _deterministic()  # a bad value fails here, before training starts
    why = gluon_missing(head_dim, dtype, device)
    if why and _backend() == "gluon":
        raise ValueError(f"{BACKEND_VARIABLE}=gluon: the Hopper kernels cannot run this model's attention: {why}")
    return {direction: "gluon" if why is None and _gluon_wanted(direction, head_dim, seq_len) else "triton"
            for direction in ("forward", "backward")}


def flash_attn_forward(q, k, v, causal=True, softmax_scale=None, doc_ids=None, window=0):
    """(o (B, H, T, D) in q's dtype, lse (B, H, T) fp32 in natural log), without autograd."""
    bnd = _checked(q, k, v, causal, doc_ids, window)
    return _forward(q, k, v, causal, softmax_scale_of(q, softmax_scale), bnd)


def flash_attn_backward(do, q, k, v, o, lse, causal=True, softmax_scale=None, doc_ids=None, window=0):
    """(dq, dk, dv), shaped and typed like q, k, v, from the forward's o and lse; deterministic."""
    bnd = _checked(q, k, v, causal, doc_ids, window)
    for name, t, like in (("do", do, q), ("o", o, q)):
        if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"flash_attn_backward: {name} must be shaped and typed like q {tuple(like.shape)} "
                             f"{like.dtype}, got {getattr(t, 'shape', type(t).__name__)}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"flash_attn_backward: lse must be the forward's float32 {tuple(q.shape[:3])} tensor")
    return _backward(do, q, k, v, o, lse, causal, softmax_scale_of(q, softmax_scale), bnd)


# --------------------------------------------------------------------------------------------
# torch.library ops, autograd, public entry point

# Under torch.compile the launchers run inside custom ops, opaque nodes with shape-only fake
# implementations, so a compiled model keeps one graph; their backward is registered with
# register_autograd (Dynamo cannot trace a hand-written autograd.Function whose q, k and v are
# one tensor). They are registered with define/impl, whose dispatch calls the Python function
# directly (torch.library.custom_op wraps it in more Python per call). Eager calls take a plain
# autograd.Function: any dispatch costs host time that short sequences cannot hide
# (docs/perf-notes.md, v3). Both take the Bounds of documents and windows, made once per call by
# flash_attention.

torch.library.define("kernels::flash_attn_fwd", "(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
                     "Tensor? key_lo, Tensor? row_hi) -> (Tensor, Tensor)")
torch.library.define("kernels::flash_attn_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                     "bool causal, float scale, Tensor? key_lo, Tensor? row_hi) -> (Tensor, Tensor, Tensor)")


@torch.library.impl("kernels::flash_attn_fwd", ("cpu", "cuda"))
def _flash_attn_fwd_op(q, k, v, causal, scale, key_lo, row_hi):
    return _forward(q, k, v, causal, scale, None if key_lo is None else Bounds(key_lo, row_hi))


@torch.library.register_fake("kernels::flash_attn_fwd")
def _(q, k, v, causal, scale, key_lo, row_hi):
    _check_inputs(q, k, v)
    B, H, T, D = q.shape
    return _empty_bhtd(B, H, T, D, q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.impl("kernels::flash_attn_bwd", ("cpu", "cuda"))
def _flash_attn_bwd_op(do, q, k, v, o, lse, causal, scale, key_lo, row_hi):
    return _backward(do, q, k, v, o, lse, causal, scale, None if key_lo is None else Bounds(key_lo, row_hi))


@torch.library.register_fake("kernels::flash_attn_bwd")
def _(do, q, k, v, o, lse, causal, scale, key_lo, row_hi):
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    return _empty_bhtd(B, H, T, D, q), _empty_bhtd(B, H_kv, S, D, k), _empty_bhtd(B, H_kv, S, D, v)


def _op_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, key_lo, row_hi = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, key_lo, row_hi)
    ctx.causal, ctx.scale = causal, scale


def _op_backward(ctx, do, dlse):  # dlse: LSE is an output for the backward only, never differentiated
    q, k, v, o, lse, key_lo, row_hi = ctx.saved_tensors
    dq, dk, dv = torch.ops.kernels.flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, key_lo, row_hi)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("kernels::flash_attn_fwd", _op_backward, setup_context=_op_setup_context)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd wrapper: the launchers without the custom-op dispatch (see above)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, bnd):
        o, lse = _forward(q, k, v, causal, scale, bnd)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.bnd = causal, scale, bnd
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return *_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.bnd), None, None, None


def autocast_inputs(q, k, v):
    """q, k, v cast to the autocast dtype if autocast is on, as autocast does for SDPA."""
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    return q, k, v


def flash_attention(q, k, v, causal=True, softmax_scale=None, doc_ids=None, window=0):
    """softmax(softmax_scale * q k^T, mask) v for q (B, H, T, D) and k, v (B, H_kv, S, D).

    Returns (B, H, T, D) in q's dtype; softmax_scale defaults to 1 / sqrt(D). doc_ids (B, T) of
    packed documents (a document is a run of equal ids; causal, T == S): query i then attends key j
    only within its own document, and the tiles of other documents are skipped. window W > 0
    (causal): query i sees only the W keys up to its own (a sliding window; with documents, within
    its document too), and the tiles outside the window are skipped.
    Under torch.autocast, q, k and v are first cast to the autocast dtype, as autocast does for
    scaled_dot_product_attention.
    """
    q, k, v = autocast_inputs(q, k, v)
    bnd = _checked(q, k, v, causal, doc_ids, window)
    scale = softmax_scale_of(q, softmax_scale)
    # the custom op where something watches the dispatcher: torch.compile, and modes such as
    # selective activation checkpointing, which must see the attention as one op to keep it
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return torch.ops.kernels.flash_attn_fwd(q, k, v, bool(causal), scale, *(bnd or (None, None)))[0]
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale, bnd)
