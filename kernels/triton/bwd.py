"""The FlashAttention-2 backward in Triton: dQ, dK, dV from dO and the forward's O and LSE.

First each row's delta = rowsum(dO * O), laid beside its LSE; then a dK/dV kernel keeps a K/V
tile resident and streams the Q/dO tiles of every query head of its group, and a dQ kernel keeps
a Q/dO tile resident and streams K/V tiles. Both recompute P = exp2(S * scale * log2(e) - LSE)
from the forward's LSE. Every output element is written by one program, without atomics: the
backward is bit-identical run to run, at the price of computing QK^T and dO V^T in both kernels
(7 matmuls per tile pair, not 5).
dQ, dK, dV are (B, H, T, D) and (B, H_kv, S, D) in the callers' tensors.
With score modifications both kernels recompute the modified scores as the forward does, and a
softcap's dS goes on through its derivative 1 - tanh^2(s / C); ALiBi's derivative is 1, and a
sink is in the LSE already (its own gradient, from LSE and delta, is kernels/api.py's).
"""

import torch
import triton
import triton.language as tl

from kernels import inputs
from kernels.runtime.launch import Launcher, on_device
from kernels.triton import config
from kernels.triton.blocks import (LOG2E, head_dim_mask, key_block, kv_ranges, load_tile, q_ranges, query_program,
                                   scores, softcap_tanh, stream, tile_ptrs, visible, visible_t)


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, LSE,  # o, do (B, H, T, D); LSE (B, H, T) fp32, natural log
    STATS,  # (B, H, 2, T) fp32: what the two kernels read of each row
    o_strides, do_strides,  # each (batch, head, sequence, head dim)
    H, T,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Each row's LSE * log2(e) and delta = rowsum(dO * O), side by side in STATS."""
    BLOCK_D: tl.constexpr = config.block_d(HEAD_DIM)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & head_dim_mask(HEAD_DIM, BLOCK_D)[None, :]
    o = tl.load(tile_ptrs(O, o_strides, off_b, off_h, rows, offs_d), mask=mask, other=0.0)
    do = tl.load(tile_ptrs(DO, do_strides, off_b, off_h, rows, offs_d), mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row0 = (off_b * H + off_h).to(tl.int64) * T
    lse = tl.load(LSE + row0 + rows, mask=rows < T, other=0.0)
    tl.store(STATS + 2 * row0 + rows, lse * LOG2E, mask=rows < T)
    tl.store(STATS + 2 * row0 + T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,  # (BLOCK_N, BLOCK_D) fp32 accumulators; resident K and V tiles
    head,  # one query head's Q and dO tiles (as blocks.stream gives them), its STATS rows at row 0
    block,  # the block's keys and their band (row_lo, row_hi); query offsets; real head dims
    m_start, m_end, sizes,  # the query blocks [m_start, m_end); (T, S, qk_scale)
    slope,  # the query head's ALiBi slope (log2 units), or None
    MASKED: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_M: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):
    INPUT_PRECISION: tl.constexpr = config.dot_precision(k.dtype)
    q_tiles, do_tiles, stats = head
    cols, band, offs_m, d_mask = block
    T, S, qk_scale = sizes
    MODIFIED: tl.constexpr = SOFTCAP > 0.0 or slope is not None
    s_scale = qk_scale  # as in the forward: the modified scores come in log2 units
    if MODIFIED:
        s_scale = 1.0
    # masked runs exist only under a causal mask (bounds need one too), so MASKED applies it
    for start_m in range(m_start, m_end, BLOCK_M):
        # -- load Q, dO, LSE, delta --
        rows = start_m + offs_m
        # rows past T load as zeros with LSE = delta = 0: their P is at most 1, but dO = 0, so they add 0
        q_mask = (rows[:, None] < T) & d_mask[None, :]
        q = load_tile(q_tiles, start_m, q_mask, TMA)
        do = load_tile(do_tiles, start_m, q_mask, TMA)
        lse = tl.load(stats + rows, mask=rows < T, other=0.0)
        delta = tl.load(stats + T + rows, mask=rows < T, other=0.0)
        # -- recompute P^T --
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        s_t = qk_t
        if MODIFIED:
            s_t = scores(qk_t, qk_scale, rows[None, :] + (S - T), cols[:, None], slope, SOFTCAP, q.dtype)
        p_t = tl.math.exp2(tl.fma(s_t, s_scale, -lse[None, :]))
        if MASKED:  # selected after exp2: a row with LSE = -inf gives inf here and is dropped, never NaN
            p_t = tl.where(visible_t(cols, rows, T, S, band, BOUNDED), p_t, 0.0)
        # -- dV += P^T dO; dK += dS^T Q --
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP > 0.0:  # on to the scaled scores through the cap's derivative
            t = softcap_tanh(qk_t, qk_scale, SOFTCAP, q.dtype)
            ds_t *= 1.0 - t * t
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, STATS, DK, DV,  # as in the forward; STATS: the preprocess's; dk, dv like k, v
    ROW_BAND,  # (2, B, S) int32, each key's first query and one past its last (Bounds.rows), or None
    ALIBI,  # (H,) fp32, each query head's ALiBi slope times log2(e), or None
    dims,  # ((q, k, v, do, dk, dv) strides, scalars as the dQ kernel's): one pair, 16 parameters in all
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_D: tl.constexpr = config.block_d(HEAD_DIM)
    BOUNDED: tl.constexpr = ROW_BAND is not None
    strides, scalars = dims  # (Triton unpacks one level at a time)
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides = strides
    H, GROUP, T, S, sm_scale, qk_scale = scalars
    start_n = tl.program_id(0) * BLOCK_N
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)

    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(HEAD_DIM, BLOCK_D)
    kv_mask = (cols[:, None] < S) & d_mask[None, :]
    # keys past S load as zeros; their dK/dV rows are computed but never stored
    k = tl.load(tile_ptrs(K, k_strides, off_b, off_hkv, cols, offs_d), mask=kv_mask, other=0.0)
    v = tl.load(tile_ptrs(V, v_strides, off_b, off_hkv, cols, offs_d), mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    band, m_start, full_start, full_hi, q_hi = q_ranges(ROW_BAND, off_b, cols, start_n, T, S, CAUSAL, BOUNDED,
                                                        BLOCK_M, BLOCK_N)
    block, sizes = (cols, band, offs_m, d_mask), (T, S, qk_scale)
    for g in range(GROUP):  # GQA: the kv head's query heads, summed in a fixed order
        off_h = off_hkv * GROUP + g
        q_tiles = stream(Q, q_strides, off_b, off_h, T, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_tiles = stream(DO, do_strides, off_b, off_h, T, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        head = (q_tiles, do_tiles, STATS + (off_b * H + off_h).to(tl.int64) * 2 * T)
        slope = None
        if ALIBI is not None:  # each query head its own slope
            slope = tl.load(ALIBI + off_h)
        # -- the query blocks: masked at the diagonal, mask-free, masked where the keys' last queries lie --
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, head, block, m_start, tl.minimum(full_start, q_hi), sizes, slope,
                                 True, BOUNDED, BLOCK_M, TMA, SOFTCAP)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, head, block, full_start, full_hi, sizes, slope,
                                 False, BOUNDED, BLOCK_M, TMA, SOFTCAP)
        if BOUNDED:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, head, block, full_hi, q_hi, sizes, slope,
                                     True, BOUNDED, BLOCK_M, TMA, SOFTCAP)

    # -- epilogue --
    dk *= sm_scale  # dS is the gradient of the scaled scores: dK = scale * dS^T Q
    tl.store(tile_ptrs(DK, dk_strides, off_b, off_hkv, cols, offs_d), dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(tile_ptrs(DV, dv_strides, off_b, off_hkv, cols, offs_d), dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(
    dq, resident,  # (BLOCK_M, BLOCK_D) fp32 accumulator; resident Q, dO, and LSE (log2 units), delta
    kv_tiles, block, n_start, n_end, sizes, slope,  # as in the forward's inner loop
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q, do, lse, delta = resident
    INPUT_PRECISION: tl.constexpr = config.dot_precision(q.dtype)
    k_tiles, v_tiles = kv_tiles
    rows, band, offs_n, d_mask = block
    T, S, qk_scale = sizes
    MODIFIED: tl.constexpr = SOFTCAP > 0.0 or slope is not None
    s_scale = qk_scale  # as in the forward: the modified scores come in log2 units
    if MODIFIED:
        s_scale = 1.0
    for start_n in range(n_start, n_end, BLOCK_N):
        # -- recompute P --
        cols, kv_mask = key_block(start_n, offs_n, d_mask, S, MASKED)
        k = load_tile(k_tiles, start_n, kv_mask, TMA)
        v = load_tile(v_tiles, start_n, kv_mask, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        s = qk
        if MODIFIED:
            s = scores(qk, qk_scale, rows[:, None] + (S - T), cols[None, :], slope, SOFTCAP, k.dtype)
        p = tl.math.exp2(tl.fma(s, s_scale, -lse[:, None]))
        if MASKED:  # selected after exp2, as in the dK/dV kernel
            p = tl.where(visible(rows, cols, T, S, band, CAUSAL, BOUNDED), p, 0.0)
        # -- dQ += dS K --
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if SOFTCAP > 0.0:  # through the cap's derivative, as in the dK/dV kernel
            t = softcap_tanh(qk, qk_scale, SOFTCAP, k.dtype)
            ds *= 1.0 - t * t
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, STATS, DQ,  # as in the dK/dV kernel; dq like q
    KEY_BAND,  # (2, B, T) int32, each query's first and last key (kernels/masking.py's Bounds.keys), or None
    ALIBI,  # (H,) fp32, each query head's ALiBi slope times log2(e), or None
    strides,  # (q, k, v, do, dq) strides, each (batch, head, sequence, head dim)
    scalars,  # (H, GROUP, T, S) as in the forward, softmax_scale, softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_D: tl.constexpr = config.block_d(HEAD_DIM)
    BOUNDED: tl.constexpr = KEY_BAND is not None
    q_strides, k_strides, v_strides, do_strides, dq_strides = strides
    H, GROUP, T, S, sm_scale, qk_scale = scalars
    start_m, off_h, off_b, off_hkv, rows, offs_n, offs_d, d_mask, row_mask = query_program(T, GROUP, HEAD_DIM, BLOCK_D,
                                                                                           BLOCK_M, BLOCK_N)
    q = tl.load(tile_ptrs(Q, q_strides, off_b, off_h, rows, offs_d), mask=row_mask, other=0.0)
    do = tl.load(tile_ptrs(DO, do_strides, off_b, off_h, rows, offs_d), mask=row_mask, other=0.0)
    stats = STATS + (off_b * H + off_h).to(tl.int64) * 2 * T
    lse = tl.load(stats + rows, mask=rows < T, other=0.0)
    delta = tl.load(stats + T + rows, mask=rows < T, other=0.0)
    k_tiles = stream(K, k_strides, off_b, off_hkv, S, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_tiles = stream(V, v_strides, off_b, off_hkv, S, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    slope = None
    if ALIBI is not None:
        slope = tl.load(ALIBI + off_h)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    band, lo, full_lo, full_end, end = kv_ranges(KEY_BAND, off_b, rows, start_m, T, S, CAUSAL, BOUNDED,
                                                 BLOCK_M, BLOCK_N)
    resident, kv_tiles = (q, do, lse, delta), (k_tiles, v_tiles)
    block, sizes = (rows, band, offs_n, d_mask), (T, S, qk_scale)
    # -- the forward's three runs of key blocks --
    if BOUNDED:
        dq = _bwd_dq_inner(dq, resident, kv_tiles, block, lo, tl.minimum(full_lo, full_end), sizes, slope,
                           True, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)
    dq = _bwd_dq_inner(dq, resident, kv_tiles, block, full_lo, full_end, sizes, slope,
                       False, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)
    dq = _bwd_dq_inner(dq, resident, kv_tiles, block, tl.maximum(lo, full_end), end, sizes, slope,
                       True, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)

    # -- epilogue --
    dq *= sm_scale
    tl.store(tile_ptrs(DQ, dq_strides, off_b, off_h, rows, offs_d), dq.to(DQ.dtype.element_ty), mask=row_mask)


PREPROCESS = Launcher(_bwd_preprocess_kernel, [config.PREPROCESS], config.PREPROCESS)
DKDV = Launcher(_bwd_dkdv_kernel, config.DKDV, config.CPU_DKDV, config.DKDV_PRUNE)
DQ = Launcher(_bwd_dq_kernel, config.DQ, config.CPU_DQ, config.DQ_PRUNE)


def backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, bounds, signature: tuple,
             softcap: float = 0.0, alibi=None) -> torch.Tensor:
    """Writes dq, dk, dv of checked inputs; bounds: masking.Bounds, or None; softcap and alibi as the
    forward's (sinks change nothing here: the forward's LSE holds them). Returns delta (B, H, T)
    fp32, rowsum(dO * O), for a sink's gradient. Later calls of the same signature reuse the first
    one's compiled launches."""
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    stats = torch.empty((B, H, 2, T), dtype=torch.float32, device=q.device)
    key_band, row_band = bounds or (None, None)
    stats_args = (o, do, lse, stats)
    dkdv_args = (q, k, v, do, stats, dk, dv, row_band, alibi)
    dq_args = (q, k, v, do, stats, dq, key_band, alibi)
    launches = [launcher.bound_for(signature) for launcher in (PREPROCESS, DKDV, DQ)]
    if all(launches):
        for launch, tensors in zip(launches, (stats_args, dkdv_args, dq_args), strict=True):
            launch(*tensors)
        return stats[:, :, 1]
    key, constexprs = config.tuning_key_and_constexprs(q, k, causal, bounds is not None, inputs.uses_tma(q, k, v, do),
                                                       softcap)
    strides = (q.stride(), k.stride(), v.stride(), do.stride())
    scalars = (H, H // H_kv, T, S, scale, scale * LOG2E.value)
    with on_device(q):
        PREPROCESS.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                        (*stats_args, o.stride(), do.stride(), H, T), key, HEAD_DIM=D)
        DKDV.bind(signature, lambda c: (triton.cdiv(S, c["BLOCK_N"]), H_kv, B),
                  (*dkdv_args, ((*strides, dk.stride(), dv.stride()), scalars)), key, **constexprs)
        DQ.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                (*dq_args, (*strides, dq.stride()), scalars), key, **constexprs)
    return stats[:, :, 1]
