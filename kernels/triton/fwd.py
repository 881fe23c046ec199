"""The FlashAttention-2 forward in Triton: O and LSE of q (B, H, T, D) against k, v (B, H_kv, S, D).

One program per (query block, head, batch) keeps its Q tile and fp32 accumulators on chip and
streams K/V tiles through an online softmax: running row max m and sum l, one rescale per tile,
one division at the end, exp2 with softmax_scale * log2(e) folded into one fma. It stores O in
q's dtype and LSE = log sum_j exp(scale q.k_j) per row, natural log, fp32 (B, H, T). The
derivation is docs/flash-attention.md; kernels/reference/flash_ref.py is the same in PyTorch.

The score modifications (kernels/score_mods.py), each a compile-time branch that costs nothing
when off: a softcap C (SOFTCAP) turns each tile's scaled scores into C tanh(s / C) and ALiBi
(ALIBI, per-head slopes) adds -slope |j - i'|, both before the tile's max and the mask; a sink
(SINKS, per-head logits) starts each row's online softmax at m = sink, l = 1, so the LSE holds it.
"""

import triton
import triton.language as tl

from kernels import inputs
from kernels.runtime.launch import Launcher, on_device
from kernels.triton import config
from kernels.triton.blocks import (LOG2E, key_block, kv_ranges, load_tile, query_program, row_start, scores, stream,
                                   tile_ptrs, visible)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running (BLOCK_M, BLOCK_D) output, row sum, row max (log2 units); Q tile
    kv_tiles,  # this kv head's K and V tiles, as blocks.stream gives them
    block,  # the block's query rows and their first keys; key offsets; real head dims
    n_start, n_end, sizes,  # the key blocks [n_start, n_end); (T, S, qk_scale)
    slope,  # the head's ALiBi slope (log2 units), or None: no ALiBi
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    INPUT_PRECISION: tl.constexpr = config.dot_precision(q.dtype)
    k_tiles, v_tiles = kv_tiles
    rows, band, offs_n, d_mask = block
    T, S, qk_scale = sizes
    MODIFIED: tl.constexpr = SOFTCAP > 0.0 or slope is not None
    s_scale = qk_scale  # what scores are multiplied by on their way into exp2: modified ones come in log2 units
    if MODIFIED:
        s_scale = 1.0
    for start_n in range(n_start, n_end, BLOCK_N):
        # -- compute qk --
        cols, kv_mask = key_block(start_n, offs_n, d_mask, S, MASKED)
        k = load_tile(k_tiles, start_n, kv_mask, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MODIFIED:  # before the mask: a masked score stays -inf, not -C
            qk = scores(qk, qk_scale, rows[:, None] + (S - T), cols[None, :], slope, SOFTCAP, k.dtype)
        if MASKED:
            qk = tl.where(visible(rows, cols, T, S, band, CAUSAL, BOUNDED), qk, float("-inf"))
        # -- online softmax: new row max, rescale --
        m_new = tl.maximum(m_i, tl.max(qk, 1) * s_scale)
        m_sub = m_new
        if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(qk, s_scale, -m_sub[:, None]))  # explicit fma: one op per score
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update acc --
        v = load_tile(v_tiles, start_n, kv_mask, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE,  # q (B, H, T, D); k, v (B, H_kv, S, D); o like q; LSE (B, H, T) fp32
    KEY_BAND,  # (2, B, T) int32, each query's first and last key (kernels/masking.py's Bounds.keys), or None
    ALIBI,  # (H,) fp32, each query head's ALiBi slope times log2(e), or None: no ALiBi
    SINKS,  # (H,) fp32, each query head's sink logit, or None: no sinks
    strides,  # (q, k, v, o) strides, each (batch, head, sequence, head dim)
    scalars,  # (H, GROUP, T, S, qk_scale): query heads, query heads per kv head, query and key lengths,
    # softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,  # SOFTCAP 0: none
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_D: tl.constexpr = config.block_d(HEAD_DIM)
    BOUNDED: tl.constexpr = KEY_BAND is not None
    q_strides, k_strides, v_strides, o_strides = strides
    H, GROUP, T, S, qk_scale = scalars
    start_m, off_h, off_b, off_hkv, rows, offs_n, offs_d, d_mask, row_mask = query_program(T, GROUP, HEAD_DIM, BLOCK_D,
                                                                                           BLOCK_M, BLOCK_N)
    q = tl.load(tile_ptrs(Q, q_strides, off_b, off_h, rows, offs_d), mask=row_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    k_tiles = stream(K, k_strides, off_b, off_hkv, S, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_tiles = stream(V, v_strides, off_b, off_hkv, S, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)

    m_i, l_i = row_start(SINKS, off_h, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slope = None
    if ALIBI is not None:
        slope = tl.load(ALIBI + off_h)
    band, lo, full_lo, full_end, end = kv_ranges(KEY_BAND, off_b, rows, start_m, T, S, CAUSAL, BOUNDED,
                                                 BLOCK_M, BLOCK_N)
    kv_tiles, block, sizes = (k_tiles, v_tiles), (rows, band, offs_n, d_mask), (T, S, qk_scale)
    # -- the key blocks: masked where the rows' first keys lie, mask-free, masked at the diagonal --
    if BOUNDED:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv_tiles, block, lo, tl.minimum(full_lo, full_end), sizes, slope,
                                   True, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv_tiles, block, full_lo, full_end, sizes, slope,
                               False, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv_tiles, block, tl.maximum(lo, full_end), end, sizes, slope,
                               True, CAUSAL, BOUNDED, BLOCK_N, TMA, SOFTCAP)

    # -- epilogue --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that attend no key (and no sink): O = 0, LSE = -inf
    o = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) / LOG2E
    tl.store(tile_ptrs(O, o_strides, off_b, off_h, rows, offs_d), o.to(O.dtype.element_ty), mask=row_mask)
    tl.store(LSE + (off_b * H + off_h).to(tl.int64) * T + rows, lse, mask=rows < T)


FWD = Launcher(_fwd_kernel, config.FWD, config.CPU_FWD, config.FWD_PRUNE)


def forward(q, k, v, o, lse, causal: bool, scale: float, key_band, signature: tuple, softcap: float = 0.0,
            alibi=None, sinks=None) -> None:
    """Writes o and lse of checked inputs; key_band: Bounds.keys, or None. softcap: C (0: none);
    alibi: kernels/score_mods.py's kernel_slopes, or None; sinks: (H,) fp32 logits, or None (the LSE
    then includes them). Later calls of the same signature (kernels/inputs.py's layout, the flags and
    the modifications) reuse the first one's compiled launch."""
    tensors = (q, k, v, o, lse, key_band, alibi, sinks)
    if bound := FWD.bound_for(signature):
        bound(*tensors)
        return
    (B, H, T, _), (H_kv, S) = q.shape, k.shape[1:3]
    key, constexprs = config.tuning_key_and_constexprs(q, k, causal, key_band is not None, inputs.uses_tma(k, v),
                                                       softcap)
    with on_device(q):
        strides = (q.stride(), k.stride(), v.stride(), o.stride())
        FWD.bind(signature, lambda c: (triton.cdiv(T, c["BLOCK_M"]), H, B),
                 (*tensors, strides, (H, H // H_kv, T, S, scale * LOG2E.value)), key, **constexprs)

