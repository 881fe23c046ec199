"""FlashDecoding: attention of a few new queries against a long KV cache, split over the keys.

Decoding asks one query row per head (or a few) to attend every cached key: the training kernels'
grid, one program per query block and head, would start B * H programs for a GPU of 132 SMs,
each streaming the whole cache alone. Here the cache is cut into n_splits chunks and every
(chunk, kv head, batch) gets its own program (Dao et al., "Flash-Decoding for long-context
inference", 2023):

    split s:  m_s, l_s, O_s = online softmax of q against keys [lo_s, hi_s)   (as the forward kernel)
              LSE_s = m_s + log l_s,  O_s normalized by l_s
    merge:    LSE = log sum_s exp(LSE_s),  O = sum_s exp(LSE_s - LSE) O_s

The merge is exact: each split's normalized output is weighted by its share of the softmax
denominator. A program reads its K/V chunk once for all GROUP query heads of its kv head and all
T new rows (stacked as GROUP * T rows of one tile), so grouped heads cost no extra cache reads.

The score modifications (kernels/score_mods.py) act on each score in the split, each a compile-time
branch, so that a kernel without them carries none of their instructions: softcap (a constexpr cap)
and ALiBi (an (H,) slopes operand; new row t's query position is i' = length - T + t, as for the
causal mask). The split kernel's scores run in log2 units, so a modification works on the scaled
score times log2(e): the cap becomes C log2(e), the slopes come pre-multiplied. A sink is a score of
no split (each would count it again): it joins each row's denominator once, in the merge,

    LSE = log(sum_s exp(LSE_s) + exp(sink_h)),  O = sum_s exp(LSE_s - LSE) O_s

The cache's length is read from a device tensor, not passed as a number: a decode step captured
in a CUDA graph (model/kv_cache.py) replays with a longer cache every token. n_splits is fixed
per call shape, and each split's chunk is computed from the length inside the kernel.

Conventions: q (B, H, T, D); k_cache, v_cache (B, H_kv, S_max, D), any strides, of which the
first `length` positions hold keys; the T queries are positions length - T .. length - 1 (the
newest), causal among themselves, and see keys j <= their own position; window W > 0: only keys
j > position - W. Returns (B, H, T, D) in q's dtype. fp16, bf16, fp32. Inference only: no backward.
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.runtime.launch import Launcher, on_device
from kernels.score_mods import ScoreMods, kernel_slopes
from kernels.triton.blocks import LOG2E, visible
from kernels.triton.config import block_d, dot_precision


@triton.jit
def _tile_probs(qk, seen, m_i, qk_scale, pos, cols, slope, SOFTCAP: tl.constexpr):
    """One tile's step of the online softmax, in log2 units: (m_new, m_sub, p), the rows' running
    max, the max subtracted (0 for a row with no key yet: exp2 gives 0, not NaN), and exp2 of the
    seen scores less it. Unmodified, the raw q.k is scaled on the way into exp2; a modification
    needs the scaled score itself, softcap first, then ALiBi's bias (kernels/score_mods.py)."""
    if SOFTCAP > 0.0 or slope is not None:
        s = qk * qk_scale
        if SOFTCAP > 0.0:
            s = _softcap(s, SOFTCAP)
        if slope is not None:  # decode is causal, so |j - i'| = i' - j for every key seen
            s += slope[:, None] * (cols[None, :] - pos[:, None]).to(tl.float32)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(qk, qk_scale, -m_sub[:, None]))
    return m_new, m_sub, p


@triton.jit
def _softcap(s, CAP: tl.constexpr):
    """C tanh(s' / C) of the scaled score s' = s / log2(e), in log2 units: with tanh x = 1 - 2 / (e^2x + 1)
    (Triton's tl.math has no tanh, and the interpreter runs no libdevice), e^(2 s' / C) = 2^(2 s / C).
    Overflow is harmless: e^2x = inf gives the cap, e^2x = 0 minus the cap."""
    cap: tl.constexpr = CAP * LOG2E
    return cap - (2.0 * cap) / (tl.math.exp2(s * (2.0 / CAP)) + 1.0)


@triton.jit
def _split_kernel(
    Q, K, V, LENGTH, O_PART, LSE_PART,  # O_PART (B, H, T, SPLITS, D) fp32; LSE_PART (B, H, T, SPLITS) fp32, log2 units
    SLOPES,  # (H,) fp32 ALiBi slopes in log2 units, or None
    strides,  # (q, k, v) strides, each (batch, head, position, head dim)
    sizes,  # (H, T, window)
    qk_scale,  # softmax_scale * log2(e)
    GROUP: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr,  # SOFTCAP 0.0: none
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    INPUT_PRECISION: tl.constexpr = dot_precision(Q.dtype.element_ty)
    q_strides, k_strides, v_strides = strides  # (Triton unpacks one level at a time)
    stride_qb, stride_qh, stride_qt, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    H, T, window = sizes
    split = tl.program_id(0)
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)
    length = tl.load(LENGTH)

    # the tile's rows: GROUP query heads x T new positions, padded to BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    off_h = off_hkv * GROUP + rows // T
    t = rows % T
    pos = length - T + t  # each row's key position
    key_lo = tl.where(window > 0, pos - window + 1, 0)  # each row's band: its first key to its own (kernels/masking.py)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64)[:, None] * stride_qh
              + t[:, None] * stride_qt + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    slope = SLOPES
    if SLOPES is not None:
        slope = tl.load(SLOPES + off_h, mask=row_ok, other=0.0)

    # the keys any row sees: from the oldest row's window start to the cache's end, cut into
    # SPLITS chunks of whole BLOCK_N tiles
    lo = 0
    if window > 0:
        lo = tl.maximum(length - T - window + 1, 0) // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(length - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, length)

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < end) & d_ok[None, :]
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask,
                    other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        seen = visible(t, cols, T, length, (key_lo, pos), True, True) & (cols[None, :] < end)
        m_new, m_sub, p = _tile_probs(qk, seen, m_i, qk_scale, pos, cols, slope, SOFTCAP)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask,
                    other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new

    # a split whose rows see none of its keys (or that has none) leaves LSE = -inf: weight 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    part = ((off_b * H + off_h) * T + t).to(tl.int64) * SPLITS + split  # (B, H, T, SPLITS) index
    tl.store(LSE_PART + part, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe)), mask=row_ok)
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, O,  # O (B, H, T, D) with these strides
    SINKS,  # (H,) fp32 sink logits, or None
    stride_ob, stride_oh, stride_ot, stride_od,
    H, T,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    row = tl.program_id(0)  # (b * H + h) * T + t
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_PART + row.to(tl.int64) * SPLITS + splits, mask=splits < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS is not None:  # the row's sink, once: one more term of the denominator, with no value
        sink = tl.load(SINKS + row // T % H) * LOG2E
        m = tl.maximum(m, sink)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_sub)  # each split's share, up to a common factor
    parts = tl.load(O_PART + (row.to(tl.int64) * SPLITS + splits)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(splits[:, None] < SPLITS) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    if SINKS is not None:
        total += tl.math.exp2(sink - m_sub)
    o = tl.sum(w[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    b = row // (H * T)
    h = row // T % H
    t = row % T
    tl.store(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + t * stride_ot + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


# streaming the cache is all a split does: deep pipelines of wide tiles, the fastest picked per shape
_SPLIT = Launcher(_split_kernel, [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                                  for n, w, s in ((128, 4, 3), (128, 4, 4), (64, 4, 4), (256, 8, 3))],
                  triton.Config({"BLOCK_N": 16}))
_MERGE = Launcher(_merge_kernel, [triton.Config({}, num_warps=4)], triton.Config({}))
MAX_SPLITS = 128
MAX_ROWS = 128  # a program's query rows, group x new positions, in one tile


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Chunks per (batch, kv head): enough programs to give every SM two, but no chunk shorter than
    256 keys (below that the merge costs more than the split saves)."""
    sms = _sms(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(2 * sms, batch * kv_heads), triton.cdiv(max_len, 256), MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor,
                     window: int = 0, softmax_scale: float | None = None, splits: int | None = None, *,
                     mods: ScoreMods | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the T newest positions q (B, H, T, D) against the first `length` (a one-element
    int32 tensor on q's device) positions of k_cache, v_cache (B, H_kv, S_max, D); causal, and
    within the last `window` keys when window > 0. splits: chunks per (batch, kv head); None:
    num_splits for S_max. mods: the score modifications (kernels/score_mods.py), None or falsy for
    none; sinks: (H,) sink logits, one per query head, or None. Returns (B, H, T, D) in q's dtype."""
    (B, H, T, D), (H_kv, S_max) = q.shape, k_cache.shape[1:3]
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D or H % H_kv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} against caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}: need (B, H_kv, S_max, D) caches with H_kv dividing H")
    if (H // H_kv) * T > MAX_ROWS:
        raise ValueError(f"decode_attention: {H // H_kv} query heads per kv head x {T} new rows exceed the "
                         f"{MAX_ROWS} rows of one tile: decode fewer rows at a time (or prefill with flash_attention)")
    if length.numel() != 1 or length.dtype != torch.int32 or length.device != q.device:
        raise ValueError(f"decode_attention: length must be a one-element int32 tensor on {q.device}")
    if sinks is not None and (sinks.shape != (H,) or sinks.device != q.device):
        raise ValueError(f"decode_attention: sinks {tuple(sinks.shape)} on {sinks.device}: need one logit per "
                         f"query head, ({H},), on {q.device}")
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":  # the interpreter's bf16 tl.dot is wrong
        out = decode_attention(q.float(), k_cache.float(), v_cache.float(), length, window, softmax_scale, splits,
                               mods=mods, sinks=sinks)
        return out.to(torch.bfloat16)
    splits = splits or num_splits(B, H_kv, S_max, q.device)
    scale = (D ** -0.5 if softmax_scale is None else softmax_scale) * LOG2E.value
    group = H // H_kv
    softcap = float(mods.softcap) if mods else 0.0
    slopes = kernel_slopes(H, q.device) if mods and mods.alibi else None
    sinks = None if sinks is None else sinks.float()  # a no-op for fp32 logits: nothing copied in a graph
    o_part = torch.empty((B, H, T, splits, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, H, T, splits), dtype=torch.float32, device=q.device)
    o = torch.empty_like(q)
    key = (q.device.index, q.dtype, block_d(D), group * T)
    with on_device(q):
        _SPLIT(lambda c: (splits, H_kv, B),
               (q, k_cache, v_cache, length, o_part, lse_part, slopes, (q.stride(), k_cache.stride(), v_cache.stride()),
                (H, T, window), scale), (*key, softcap > 0, slopes is not None),
               GROUP=group, SPLITS=splits, HEAD_DIM=D, SOFTCAP=softcap,
               BLOCK_M=max(16, triton.next_power_of_2(group * T)))
        _MERGE(lambda c: (B * H * T,), (o_part, lse_part, o, sinks, *o.stride(), H, T), key,
               SPLITS=splits, HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return o

