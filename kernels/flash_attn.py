"""FlashAttention-2 forward and backward in Triton.

Algorithm (Dao, "FlashAttention-2", 2023). Forward: one program per (query block, head, batch)
keeps its Q tile and fp32 accumulators on chip and streams K/V tiles; an online softmax keeps a
running row max m and row sum l in fp32 and rescales the accumulator by exp(m_old - m_new) per
tile; the division by l happens once, at the end. Probabilities come from exp2, with
softmax_scale * log2(e) folded into one multiply-add per score. Per query row the kernel
stores LSE = log(sum_j exp(scale * q.k_j)) in NATURAL log (fp32, (B, H, T)); the backward
kernels convert it to base 2 with one multiply per row. The backward recomputes
P = exp(scale * QK^T - LSE) tile by tile, never storing a T x S matrix: a preprocess kernel
computes delta = rowsum(dO * O); a dK/dV kernel keeps a K/V tile resident and streams Q/dO
tiles; a dQ kernel keeps a Q/dO tile resident and streams K/V tiles. Every output element is
written by exactly one program and nothing uses atomics, so the backward is deterministic
(bit-identical run to run), at the price of computing QK^T and dO V^T in both kernels
(7 matmuls per pair of tiles instead of 5).

Conventions:
- q is (B, H, T, D); k and v are (B, H_kv, S, D) with H % H_kv == 0 (grouped-query attention:
  query head h reads kv head h // (H // H_kv)); the dK/dV program of a kv head sums over its
  query heads itself, in a fixed order.
- causal=True is bottom-right aligned, as in FlashAttention-2 >= 2.1: query i attends key j iff
  j <= i + S - T. For T == S this is SDPA's is_causal mask. For T > S the first T - S rows
  attend no key: their output is 0, their LSE is -inf and their gradients are 0.
- Any strides (transposed views are read in place), any T, S >= 1, D <= 256 (tiles pad the head
  dim to a power of two >= 16 and mask the rest), fp16 / bf16 / fp32 inputs with fp32
  accumulation; fp32 inputs use input_precision="ieee", i.e. true fp32 matmuls, not tf32.
- O, dQ, dK and dV are allocated in (B, T, H, D) memory order and returned as (B, H, T, D)
  views, as SDPA's flash backend does, so the usual transpose back to (B, T, H * D) is free.

Causal block skipping: a query block visits only the key blocks left of the diagonal. The
blocks that every row of the query block sees in full run an unmasked loop; only blocks that
straddle the diagonal or the end of the keys run the masked loop (tutorial 06's two "stages").
The dK/dV kernel mirrors this: its Q loop starts at the first query block that sees its keys.

Tuning: on a GPU each attention kernel is autotuned over its two block sizes, 4 or 8 warps and
2-4 pipeline stages, keyed on the padded head dim, causal, dtype and the power-of-two buckets
of T and S; configs whose tiles overflow shared memory or registers are pruned unbenchmarked.
Every kernel writes each of its outputs exactly once, so benchmarking cannot corrupt results.
FLASH_ATTENTION_AUTOTUNE=0 skips the benchmark and takes the largest tiles that fit (quick
start-up, e.g. for tests). Under the interpreter one small fixed config runs.

Compared with Triton's tutorial 06 (fused attention): pointer arithmetic with masks instead of
TMA descriptors (any strides, non-power-of-two D, T and S not multiples of the block), GQA, a
separate dQ kernel instead of one kernel doing both passes, K is not pre-scaled on the host
(the scale sits in the exp2 multiply-add instead), causal query blocks are launched
longest-first. Not supported: dropout, attention bias, sliding windows, variable lengths.

PyTorch integration: the forward and backward launchers are torch.library custom ops with
fake (shape-only) implementations, and the backward is registered on the forward op with
register_autograd, so torch.compile keeps them as single nodes in one graph (fullgraph=True
works). Under torch.autocast, flash_attention first casts q, k and v to the autocast dtype, as
autocast does for scaled_dot_product_attention.

Without CUDA this module turns on Triton's CPU interpreter (below), also when triton was
imported before it. The interpreter's tl.dot is wrong for bf16, so there bf16 inputs are
computed in fp32 and the results rounded to bf16. kernels/flash_ref.py is the same algorithm
in plain PyTorch.
"""

import contextlib
import math
import os
import sys

import torch

# Triton picks the interpreter when a @triton.jit decorator runs, reading TRITON_INTERPRET
# through triton.knobs, which reads the process environment on every access; so setting it
# here, before the kernels below are defined, switches them to the interpreter. setdefault
# keeps a TRITON_INTERPRET the user chose.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_INTERPRET = triton.knobs.runtime.interpret


def _rebuild_triton_language_for_interpreter():
    """Triton's own @jit functions (tl.max, tl.sum, tl.zeros, ...) are built when triton is first
    imported. If that happened before TRITON_INTERPRET was set (torch.compile imports triton),
    they are GPU functions that the interpreter refuses to call: rebuild them as importing
    triton with TRITON_INTERPRET=1 would have. Each function is wrapped once, so that the
    interpreter's identity checks on reduction combine functions keep holding."""
    wrapped = {}  # id(JITFunction) -> InterpretedFunction (hashing a JITFunction compiles its cache key)
    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    if id(value) not in wrapped:
                        wrapped[id(value)] = InterpretedFunction(value.fn)
                    setattr(module, attr, wrapped[id(value)])


if _INTERPRET and isinstance(tl.zeros, JITFunction):
    _rebuild_triton_language_for_interpreter()

_LOG2E = tl.constexpr(math.log2(math.e))
_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# --------------------------------------------------------------------------------------------
# autotuning

# Per-program budgets for pruning configs before benchmarking, calibrated against Triton 3.9's
# sm_90 compiles (shared memory as allocated, ptxas register and spill reports) for D in
# {64, 80, 128, 256}. Shared memory: H100 allows 227 KB per block; the estimate in _pruner is
# within 0.5 KB of what Triton allocates. Registers: every config above 192 live fp32 values
# per thread spilled 1 KB or more; at or below it, spills ranged from none to ~2 KB, so
# the benchmark decides.
_SMEM_BYTES = 226 * 1024
_FP32_PER_THREAD = 192


def _configs(resident, streamed, *candidates):
    """triton.Configs from (resident rows, streamed rows, num_warps, num_stages) tuples."""
    return [triton.Config({resident: r, streamed: s}, num_warps=w, num_stages=n) for r, s, w, n in candidates]


def _pruner(resident, streamed, resident_tiles, acc_tiles, score_tiles):
    """early_config_prune: drop configs whose tiles overflow shared memory or registers.

    Per program: resident_tiles (rows, D) input tiles stay in shared memory (Q; Q and dO; K
    and V), two streamed (rows, D) tiles are buffered per pipeline stage; acc_tiles (rows, D)
    fp32 accumulators and score_tiles (resident rows, streamed rows) fp32 tiles (S or P, dP)
    live in registers.
    """

    def prune(configs, named_args, **kwargs):
        d, itemsize = kwargs["BLOCK_D"], named_args["Q"].element_size()

        def area(c):
            return c.kwargs[resident] * c.kwargs[streamed]

        def smem(c):
            return (resident_tiles * c.kwargs[resident] + 2 * c.num_stages * c.kwargs[streamed]) * d * itemsize

        def fp32_per_thread(c):
            return (acc_tiles * c.kwargs[resident] * d + score_tiles * area(c)) / (32 * c.num_warps)

        kept = [c for c in configs if smem(c) <= _SMEM_BYTES and fp32_per_thread(c) <= _FP32_PER_THREAD]
        if not kept:
            return [min(configs, key=lambda c: (area(c), -c.num_warps))]
        if os.environ.get("FLASH_ATTENTION_AUTOTUNE", "1") == "0":
            return kept[:1]  # the lists below are in order of preference: nothing is benchmarked
        return kept

    return prune


if _INTERPRET:
    # CPU: one fixed config, so nothing is benchmarked; small blocks, so that test shapes span
    # several blocks, and BLOCK_M != BLOCK_N both ways round to exercise the block arithmetic
    _FWD_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})]
    _DQ_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})]
    _DKDV_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})]
else:
    # Candidates in order of preference, from scripts/tune_attention.py on an H100 (causal bf16,
    # D 64 and 128, T 1024 and 8192; docs/perf-notes.md has the table): each of the first ones
    # won or came within 3% somewhere. The small tiles at the end are what fits at D = 256.
    _FWD_CONFIGS = _configs("BLOCK_M", "BLOCK_N",
                            (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                            (64, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2))
    _DQ_CONFIGS = _configs("BLOCK_M", "BLOCK_N",
                           (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                           (64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2))
    _DKDV_CONFIGS = _configs("BLOCK_N", "BLOCK_M",
                             (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                             (64, 16, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2))

# tensor dtypes join the key automatically; T and S enter as power-of-two buckets so that a
# new sequence length does not retune
_TUNE_KEY = ["BLOCK_D", "CAUSAL", "T_BUCKET", "S_BUCKET"]

# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_ptrs(base, off_b, off_h, stride_b, stride_h, rows, stride_t, offs_d, stride_d):
    """(len(rows), len(offs_d)) pointers into a (B, H, T, D) tensor. The batch and head offsets
    are int64: B * H * T * D can pass 2**31."""
    base += off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
    return base + rows[:, None] * stride_t + offs_d[None, :] * stride_d


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
    if CAUSAL:  # row i sees keys j <= i + S - T
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
def _visible(rows, cols, T, S, CAUSAL: tl.constexpr):
    """(len(rows), len(cols)) mask of the scores a query row may attend: real keys, and under
    the bottom-right causal mask only keys j <= i + S - T."""
    visible = cols[None, :] < S
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + (S - T))
    return visible


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running (BLOCK_M, BLOCK_D) output, row sum, row max (log2 units); Q tile
    k_ptrs, v_ptrs,  # (BLOCK_N, BLOCK_D) pointers at key 0 of this kv head
    stride_kn, stride_vn,
    rows, offs_n, d_mask,
    n_start, n_end, T, S, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    k_ptrs += n_start * stride_kn
    v_ptrs += n_start * stride_vn
    for start_n in range(n_start, n_end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = d_mask[None, :]
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < S)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            qk = tl.where(_visible(rows, cols, T, S, CAUSAL), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(qk, qk_scale, -m_sub[:, None]))  # explicit fma: one op per score
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _pruner("BLOCK_M", "BLOCK_N", 1, 1, 1)})
@triton.jit
def _fwd_kernel(
    # pointers
    Q, K, V, O, LSE,
    # strides: batch, head, sequence, head dim
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    # sizes and scale
    H, GROUP, T, S,
    qk_scale,  # softmax_scale * log2(e)
    T_BUCKET, S_BUCKET,  # autotuning key only
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    k_ptrs = _tile_ptrs(K, off_b, off_hkv, stride_kb, stride_kh, offs_n, stride_kn, offs_d, stride_kd)
    v_ptrs = _tile_ptrs(V, off_b, off_hkv, stride_vb, stride_vh, offs_n, stride_vn, offs_d, stride_vd)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, end = _kv_block_range(start_m, T, S, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, d_mask,
                               0, full_end, T, S, qk_scale, False, CAUSAL, INPUT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, d_mask,
                               full_end, end, T, S, qk_scale, True, CAUSAL, INPUT_PRECISION, BLOCK_N)

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
    q_ptrs, do_ptrs,  # (BLOCK_M, BLOCK_D) pointers at query row 0 of one query head
    lse_ptr, delta_ptr,  # LSE and delta of that head's row 0
    stride_qt, stride_dot,
    offs_m, cols, d_mask,
    m_start, m_end, T, S, qk_scale,
    MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):
    q_ptrs += m_start * stride_qt
    do_ptrs += m_start * stride_dot
    for start_m in range(m_start, m_end, BLOCK_M):
        rows = start_m + offs_m
        # rows past T load as zeros with LSE = delta = 0: their P is 1, but dO = 0, so they add 0
        q_mask = (rows[:, None] < T) & d_mask[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        do = tl.load(do_ptrs, mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=rows < T, other=0.0) * _LOG2E
        delta = tl.load(delta_ptr + rows, mask=rows < T, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(tl.fma(qk_t, qk_scale, -lse[None, :]))
        if MASKED:  # selected after exp2: a row with LSE = -inf gives inf here and is dropped, never NaN
            p_t = tl.where(cols[:, None] <= rows[None, :] + (S - T), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        q_ptrs += BLOCK_M * stride_qt
        do_ptrs += BLOCK_M * stride_dot
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _pruner("BLOCK_N", "BLOCK_M", 2, 2, 2)})
@triton.jit
def _bwd_dkdv_kernel(
    # pointers
    Q, K, V, DO, LSE, DELTA, DK, DV,
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
    T_BUCKET, S_BUCKET,  # autotuning key only
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    for g in range(GROUP):  # GQA: the kv head's query heads, summed in a fixed order
        off_h = off_hkv * GROUP + g
        q_ptrs = _tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, offs_m, stride_qt, offs_d, stride_qd)
        do_ptrs = _tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, offs_m, stride_dot, offs_d, stride_dod)
        row0 = (off_b * H + off_h).to(tl.int64) * T
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE + row0, DELTA + row0, stride_qt, stride_dot,
                                 offs_m, cols, d_mask, m_start, full_start, T, S, qk_scale,
                                 True, INPUT_PRECISION, BLOCK_M)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE + row0, DELTA + row0, stride_qt, stride_dot,
                                 offs_m, cols, d_mask, full_start, T, T, S, qk_scale,
                                 False, INPUT_PRECISION, BLOCK_M)

    dk *= sm_scale  # dS is the gradient of the scaled scores: dK = scale * dS^T Q
    tl.store(_tile_ptrs(DK, off_b, off_hkv, stride_dkb, stride_dkh, cols, stride_dkn, offs_d, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(_tile_ptrs(DV, off_b, off_hkv, stride_dvb, stride_dvh, cols, stride_dvn, offs_d, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta,  # (BLOCK_M, BLOCK_D) fp32 accumulator; resident Q, dO; LSE (log2 units), delta
    k_ptrs, v_ptrs,  # (BLOCK_N, BLOCK_D) pointers at key 0 of this kv head
    stride_kn, stride_vn,
    rows, offs_n, d_mask,
    n_start, n_end, T, S, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    k_ptrs += n_start * stride_kn
    v_ptrs += n_start * stride_vn
    for start_n in range(n_start, n_end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = d_mask[None, :]
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < S)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(tl.fma(qk, qk_scale, -lse[:, None]))
        if MASKED:  # selected after exp2, as in the dK/dV kernel
            p = tl.where(_visible(rows, cols, T, S, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _pruner("BLOCK_M", "BLOCK_N", 2, 1, 2)})
@triton.jit
def _bwd_dq_kernel(
    # pointers
    Q, K, V, DO, LSE, DELTA, DQ,
    # strides: batch, head, sequence, head dim
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    # sizes and scales
    H, GROUP, T, S,
    sm_scale, qk_scale,  # softmax_scale, and softmax_scale * log2(e)
    T_BUCKET, S_BUCKET,  # autotuning key only
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    k_ptrs = _tile_ptrs(K, off_b, off_hkv, stride_kb, stride_kh, offs_n, stride_kn, offs_d, stride_kd)
    v_ptrs = _tile_ptrs(V, off_b, off_hkv, stride_vb, stride_vh, offs_n, stride_vn, offs_d, stride_vd)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, end = _kv_block_range(start_m, T, S, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, d_mask,
                       0, full_end, T, S, qk_scale, False, CAUSAL, INPUT_PRECISION, BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, d_mask,
                       full_end, end, T, S, qk_scale, True, CAUSAL, INPUT_PRECISION, BLOCK_N)

    dq *= sm_scale
    tl.store(_tile_ptrs(DQ, off_b, off_h, stride_dqb, stride_dqh, rows, stride_dqt, offs_d, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# launchers


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
    if q.device.type == "cpu" and not _INTERPRET:
        raise ValueError("flash_attention: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "importing kernels, or move q, k and v to a CUDA device")
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
    if D > _MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim {D} is not supported: head_dim must be at most {_MAX_HEAD_DIM}")
    if 0 in (B, H, T, S, D):
        raise ValueError(f"flash_attention: empty input q {tuple(q.shape)}, k {tuple(k.shape)}: "
                         "every dimension must be at least 1")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # offsets within one head are int32 in the kernels (batch and head offsets are int64)
        if (t.shape[2] - 1) * t.stride(2) + (D - 1) * t.stride(3) >= 2**31:
            raise ValueError(f"flash_attention: {name} {tuple(t.shape)} with strides {t.stride()} spans 2**31 "
                             "elements or more within one head: use shorter sequences")


def _empty_bhtd(B, H, T, D, like):
    """A (B, H, T, D) tensor laid out in (B, T, H, D) memory order."""
    return torch.empty((B, T, H, D), dtype=like.dtype, device=like.device).transpose(1, 2)


def _on_device(t):
    """Triton launches on the current CUDA device: make it t's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _launch_meta(q, k, causal):
    """Keyword arguments that every attention kernel takes: tuning buckets and constexprs."""
    D, T, S = q.shape[3], q.shape[2], k.shape[2]
    return {
        "T_BUCKET": triton.next_power_of_2(T),
        "S_BUCKET": triton.next_power_of_2(S),
        "HEAD_DIM": D,
        "BLOCK_D": max(16, triton.next_power_of_2(D)),
        "CAUSAL": causal,
        "INPUT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only matters for fp32
    }


def _flash_attn_forward(q, k, v, causal, scale):
    """(o (B, H, T, D) in q's dtype, lse (B, H, T) fp32 in natural log)."""
    _check_inputs(q, k, v)
    if _INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's tl.dot is wrong for bf16
        o, lse = _flash_attn_forward(q.float(), k.float(), v.float(), causal, scale)
        return o.to(torch.bfloat16), lse
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    o = _empty_bhtd(B, H, T, D, q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    with _on_device(q):
        _fwd_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            H, H // H_kv, T, S, scale * _LOG2E.value,
            **_launch_meta(q, k, causal),
        )
    return o, lse


def _flash_attn_backward(do, q, k, v, o, lse, causal, scale):
    """(dq, dk, dv), shaped and typed like q, k, v; deterministic."""
    if _INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's tl.dot is wrong for bf16
        grads = _flash_attn_backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, scale)
        return tuple(g.to(torch.bfloat16) for g in grads)
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    launch_meta = _launch_meta(q, k, causal)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    dq, dk, dv = _empty_bhtd(B, H, T, D, q), _empty_bhtd(B, H_kv, S, D, k), _empty_bhtd(B, H_kv, S, D, v)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    sizes = (H, H // H_kv, T, S, scale, scale * _LOG2E.value)
    with _on_device(q):
        _bwd_preprocess_kernel[(triton.cdiv(T, 64), H, B)](
            o, do, delta, *o.stride(), *do.stride(), H, T,
            HEAD_DIM=D, BLOCK_D=launch_meta["BLOCK_D"], BLOCK_M=64,
        )
        _bwd_dkdv_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), H_kv, B)](
            q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), *dv.stride(), *sizes, **launch_meta,
        )
        _bwd_dq_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)](
            q, k, v, do, lse, delta, dq, *strides, *dq.stride(), *sizes, **launch_meta,
        )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# torch.library ops, autograd, public entry point

# Two doors to the same launchers. Under torch.compile they run inside custom ops, which the
# compiler treats as opaque nodes with the fake (shape-only) implementations below, so a
# compiled model keeps one graph instead of breaking at the Triton launch; their backward is
# registered with register_autograd (Dynamo cannot trace a hand-written autograd.Function whose
# q, k and v are one tensor: "duplicate tensor input"). In eager mode a plain
# torch.autograd.Function calls the launchers directly: the custom-op dispatch costs host time
# that short sequences cannot hide (docs/perf-notes.md, v3).


@torch.library.custom_op("kernels::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _flash_attn_forward(q, k, v, causal, scale)


@_flash_attn_fwd_op.register_fake
def _(q, k, v, causal, scale):
    _check_inputs(q, k, v)
    B, H, T, D = q.shape
    return _empty_bhtd(B, H, T, D, q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("kernels::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _flash_attn_backward(do, q, k, v, o, lse, causal, scale)


@_flash_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    (B, H, T, D), (H_kv, S) = q.shape, k.shape[1:3]
    return _empty_bhtd(B, H, T, D, q), _empty_bhtd(B, H_kv, S, D, k), _empty_bhtd(B, H_kv, S, D, v)


def _save_for_backward(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, dlse):  # dlse: LSE is an output for the backward only, never differentiated
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_flash_attn_fwd_op.register_autograd(_backward, setup_context=_save_for_backward)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd wrapper: the launchers without the custom-op dispatch (see the comment above)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _flash_attn_forward(q, k, v, causal, scale)
        _save_for_backward(ctx, (q, k, v, causal, scale), (o, lse))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return *_flash_attn_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale), None, None


def flash_attention(q, k, v, causal=True, softmax_scale=None):
    """softmax(softmax_scale * q k^T, causal mask) v for q (B, H, T, D) and k, v (B, H_kv, S, D).

    The causal mask is bottom-right aligned: query i sees key j iff j <= i + S - T (SDPA's
    is_causal when T == S). softmax_scale defaults to 1 / sqrt(D). Returns (B, H, T, D) in q's
    dtype. Under torch.autocast, q, k and v are first cast to the autocast dtype, as autocast
    does for scaled_dot_product_attention.
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    _check_inputs(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():
        return _flash_attn_fwd_op(q, k, v, bool(causal), scale)[0]
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale)
