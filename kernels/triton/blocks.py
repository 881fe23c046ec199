"""The portable kernels' blocks: which tiles a program visits and which of their scores it masks
(kernels/masking.py's rule, computed once here for the forward and both backward kernels), and
how a tile of a (B, H, T, D) tensor is addressed: through pointers, or a TMA descriptor.

A program's tiles fall into runs: masked tiles where its rows' first keys lie (bounded only),
mask-free tiles every row sees whole, masked tiles on the diagonal and past the keys' end. Each
kernel walks the runs with one inner loop, MASKED a constexpr, so mask-free tiles pay no mask.
Strides come as one tuple per tensor: (batch, head, sequence, head dim). Also what the score
modifications and sinks (kernels/score_mods.py) do to a tile's scores and a row's softmax.
"""

import math

import triton
import triton.language as tl

from kernels.runtime.launch import INTERPRET_ALL

LOG2E = tl.constexpr(math.log2(math.e))  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2E)
# whether these functions run in Triton's interpreter, which runs no inline PTX: TRITON_INTERPRET=1
# at import, or (kernels/runtime/internals.py) in the interpreted twins' copy of these globals
INTERPRETED = tl.constexpr(INTERPRET_ALL)

# --------------------------------------------------------------------------------------------
# addressing


@triton.jit
def tile_ptrs(base, strides, off_b, off_h, rows, offs_d):
    """(len(rows), len(offs_d)) pointers into a (B, H, T, D) tensor. Offsets are int64: one head of
    a fused (T, 3 * H * D) projection passes 2**31 elements at ~0.9M tokens (D = 64, H = 12)."""
    stride_b, stride_h, stride_t, stride_d = strides
    base += off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
    return base + rows.to(tl.int64)[:, None] * stride_t + offs_d[None, :] * stride_d


@triton.jit
def stream(base, strides, off_b, off_h, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
           BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """(source, row stride) of one head's streamed (BLOCK_ROWS, BLOCK_D) tiles of a (B, H, T, D)
    tensor, for load_tile: a TMA descriptor of its (n_rows, HEAD_DIM) matrix (head dim contiguous;
    reads past either end return zeros), or the pointers of the tile at row 0."""
    stride_b, stride_h, stride_t, stride_d = strides
    if TMA:
        base += off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_t, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D]), stride_t
    else:
        return tile_ptrs(base, strides, off_b, off_h, tl.arange(0, BLOCK_ROWS), tl.arange(0, BLOCK_D)), stride_t


@triton.jit
def load_tile(source, row, ptr_mask, TMA: tl.constexpr):
    """The streamed tile at `row`: through its descriptor (TMA), or row * stride (int64, as in
    tile_ptrs) past the pointers of row 0 under ptr_mask."""
    src, stride_t = source
    if TMA:
        return src.load([row, 0])
    else:
        return tl.load(src + tl.cast(row, tl.int64) * stride_t, mask=ptr_mask, other=0.0)


@triton.jit
def head_dim_mask(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_D,) mask of the real head dims: a constant when D is a power of two >= 16, which
    the compiler drops from the loads."""
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return tl.arange(0, BLOCK_D) < HEAD_DIM


# --------------------------------------------------------------------------------------------
# a program's blocks


@triton.jit
def query_program(T, GROUP, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """What a program of the forward or dQ kernel owns: (start_m, off_h, off_b, off_hkv) its query
    block, head, batch and kv head, the longest causal rows first so that short ones fill the
    tail of the launch; (rows, offs_n, offs_d, d_mask, row_mask) its tiles' offsets and masks."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(HEAD_DIM, BLOCK_D)
    row_mask = (rows[:, None] < T) & d_mask[None, :]
    return start_m, off_h, off_b, off_hkv, rows, offs_n, offs_d, d_mask, row_mask


@triton.jit
def key_block(start_n, offs_n, d_mask, S, MASKED: tl.constexpr):
    """(cols, kv_mask): the keys of the streamed block at start_n and the load mask of its K and V
    tiles: the real head dims, and (MASKED) the real keys."""
    cols = start_n + offs_n
    kv_mask = d_mask[None, :]
    if MASKED:
        kv_mask = kv_mask & (cols[:, None] < S)
    return cols, kv_mask


# --------------------------------------------------------------------------------------------
# the element mask


@triton.jit
def visible(rows, cols, T, S, band, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):
    """(len(rows), len(cols)) mask of the scores a query row may attend: bounded (documents, a
    window, a prefix), the keys of each row's band (key_lo, key_hi); otherwise the real keys, under
    the bottom-right causal mask only keys j <= i + S - T."""
    if BOUNDED:
        key_lo, key_hi = band
        visible = (cols[None, :] >= key_lo[:, None]) & (cols[None, :] <= key_hi[:, None])
    else:
        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + (S - T))
    return visible


@triton.jit
def visible_t(cols, rows, T, S, band, BOUNDED: tl.constexpr):
    """visible's transpose, (len(cols), len(rows)), for the dK/dV kernel's masked tiles, which
    exist only under the causal mask: key j <= i + S - T; bounded, the queries of each key's band
    (row_lo, row_hi). Keys past S are left in: their dK and dV rows are never stored."""
    if BOUNDED:
        row_lo, row_hi = band
        visible_t = (rows[None, :] >= row_lo[:, None]) & (rows[None, :] < row_hi[:, None])
    else:
        visible_t = cols[:, None] <= rows[None, :] + (S - T)
    return visible_t


# --------------------------------------------------------------------------------------------
# score modifications and sinks (kernels/score_mods.py): compile-time branches, none taken when off


@triton.jit
def softcap_tanh(qk, qk_scale, SOFTCAP: tl.constexpr, DTYPE: tl.constexpr):
    """tanh(s / C) of the scaled scores s = softmax_scale * qk (qk_scale: that times log2(e); C =
    SOFTCAP) for inputs of DTYPE. 16-bit inputs on a GPU: the hardware's tanh, one instruction,
    within 2^-11 relative, below their own rounding of a score; fp32 and the interpreter: exactly,
    as 1 - 2 / (e^(2 s / C) + 1), which saturates to +-1 where exp2 overflows, never NaN."""
    x = qk * (qk_scale / (SOFTCAP * LOG2E))  # s / C
    if INTERPRETED or DTYPE == tl.float32:
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    else:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return t


@triton.jit
def scores(qk, qk_scale, q_pos, k_pos, slope, SOFTCAP: tl.constexpr, DTYPE: tl.constexpr):
    """The modified scores in log2 units, of qk = q . k for inputs of DTYPE: capped, C tanh(s / C)
    for SOFTCAP = C > 0 (s = softmax_scale * qk), then ALiBi's bias -slope |j - i'| (slope: log2
    units, None for none) at key positions k_pos j and query positions q_pos i' = i + S - T
    (broadcastable to qk)."""
    if SOFTCAP > 0.0:
        s = softcap_tanh(qk, qk_scale, SOFTCAP, DTYPE) * (SOFTCAP * LOG2E)
    else:
        s = qk * qk_scale
    if slope is not None:
        s -= slope * tl.abs(k_pos - q_pos).to(tl.float32)
    return s


@triton.jit
def row_start(SINKS, off_h, BLOCK_M: tl.constexpr):
    """(m, l): the running max (log2 units) and sum of each row before its first key: -inf and 0;
    with sinks (SINKS: (H,) fp32 logits, natural units), head off_h's sink seen first, a key of no
    value: its logit and 1, so a row that sees no key gets O = 0 and LSE = its sink."""
    if SINKS is not None:
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.load(SINKS + off_h) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


# --------------------------------------------------------------------------------------------
# tile ranges


@triton.jit
def kv_block_range(start_m, T, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
def q_block_range(start_n, T, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
def bounded_kv_range(KEY_BAND, off_b, start_m, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bounded (KEY_BAND: Bounds.keys, (2, B, T)), query rows [start_m, start_m + BLOCK_M) of batch
    row off_b attend keys from lo (the tile of the first row's key_lo) to end (past the last row's
    key_hi); keys from full_lo to full_end are seen by every row: both bounds grow with the row, so
    the last row's key_lo and the first row's key_hi decide."""
    key_lo = KEY_BAND + off_b.to(tl.int64) * T
    key_hi = key_lo + tl.num_programs(2).to(tl.int64) * T  # the grid's third axis is the batch
    last = tl.minimum(start_m + BLOCK_M, T) - 1
    lo = tl.load(key_lo + start_m) // BLOCK_N * BLOCK_N
    full_lo = tl.cdiv(tl.load(key_lo + last), BLOCK_N) * BLOCK_N
    full_end = (tl.load(key_hi + start_m) + 1) // BLOCK_N * BLOCK_N
    end = tl.load(key_hi + last) + 1
    return key_lo, key_hi, lo, full_lo, full_end, end


@triton.jit
def bounded_q_range(ROW_BAND, off_b, start_n, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bounded (ROW_BAND: Bounds.rows, (2, B, S)), keys [start_n, start_n + BLOCK_N) of batch row
    off_b are attended by query rows from start (the block of the first key's row_lo) to q_hi (the
    last key's row_hi); rows from full_start to full_hi see all of them: both bounds grow with the
    key, so the last key's row_lo and the first key's row_hi decide."""
    row_lo = ROW_BAND + off_b.to(tl.int64) * S
    row_hi = row_lo + tl.num_programs(2).to(tl.int64) * S  # the grid's third axis is the batch
    last = tl.minimum(start_n + BLOCK_N, S) - 1
    start = tl.load(row_lo + start_n) // BLOCK_M * BLOCK_M
    full_start = tl.minimum(tl.cdiv(tl.load(row_lo + last), BLOCK_M) * BLOCK_M, T)
    q_hi = tl.load(row_hi + last)
    full_hi = tl.maximum(tl.load(row_hi + start_n) // BLOCK_M * BLOCK_M, full_start)
    return row_lo, row_hi, start, full_start, full_hi, q_hi


@triton.jit
def kv_ranges(KEY_BAND, off_b, rows, start_m, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the forward and dQ kernels need of query rows [start_m, start_m + BLOCK_M) of batch row
    off_b (KEY_BAND: Bounds.keys, (2, B, T); None unbounded): (band, each row's first and last key,
    for visible; lo, full_lo, full_end, end), the key blocks they visit in three runs: masked
    [lo, min(full_lo, full_end)) where the rows' first keys lie (empty unbounded), mask-free
    [full_lo, full_end), masked [max(lo, full_end), end) on the diagonal (or past a prefix's end)
    and past the keys' end."""
    if BOUNDED:
        key_lo, key_hi, lo, full_lo, full_end, end = bounded_kv_range(KEY_BAND, off_b, start_m, T, BLOCK_M, BLOCK_N)
        band = (tl.load(key_lo + rows, mask=rows < T, other=0), tl.load(key_hi + rows, mask=rows < T, other=-1))
    else:
        full_end, end = kv_block_range(start_m, T, S, CAUSAL, BLOCK_M, BLOCK_N)
        lo = 0
        full_lo = 0
        band = (rows, rows)  # unread
    return band, lo, full_lo, full_end, end


@triton.jit
def q_ranges(ROW_BAND, off_b, cols, start_n, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the dK/dV kernel needs of keys cols = [start_n, start_n + BLOCK_N) of batch row off_b
    (ROW_BAND: Bounds.rows, (2, B, S); None unbounded): (band, each key's first query and one past
    its last, for visible_t; start, full_start, full_hi, q_hi), the query blocks that see them in
    three runs: masked [start, min(full_start, q_hi)) on the diagonal (or from a prefix's first
    query), mask-free [full_start, full_hi), masked [full_hi, q_hi) where the keys' last queries lie
    (empty unbounded)."""
    if BOUNDED:
        row_lo, row_hi, start, full_start, full_hi, q_hi = bounded_q_range(ROW_BAND, off_b, start_n, T, S, BLOCK_M,
                                                                           BLOCK_N)
        band = (tl.load(row_lo + cols, mask=cols < S, other=T), tl.load(row_hi + cols, mask=cols < S, other=0))
    else:
        start, full_start = q_block_range(start_n, T, S, CAUSAL, BLOCK_M, BLOCK_N)
        full_hi = T
        q_hi = T
        band = (cols, cols)  # unread
    return band, start, full_start, full_hi, q_hi
