"""The Hopper kernels' blocks: which tiles a program visits and which of their scores it masks
(kernels/masking.py's rule, computed once here for the forward and the backward), the wgmma
layout of a dQ share, and the host TMA descriptors that feed them.

Gluon cannot call the portable kernels' @triton.jit helpers (kernels/triton/blocks.py), and counts
in key blocks where they count in keys: tests/test_blocks.py runs both in Triton's interpreter and
checks that they agree, with kernels/reference/flash_ref.py's dense mask as the arbiter.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# --------------------------------------------------------------------------------------------
# the element mask


@gluon.jit
def visible(rows, keys, T, S, key_lo, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """(len(rows), len(keys)): whether query rows[i] may attend keys[j]: a real key; causal,
    bottom-right (j <= i + S - T); bounded, from the row's first key (key_lo: each row's) on.
    The row's end (causal, and S) is one bound made once a row, so that a score costs one compare
    and one select (bounded, two of each)."""
    hi = S + rows * 0  # one past the row's last key
    if CAUSAL:
        hi = gl.minimum(rows + (S - T + 1), S)
    visible = keys[None, :] < hi[:, None]
    if BOUNDED:
        visible = visible & (keys[None, :] >= key_lo[:, None])
    return visible


@gluon.jit
def visible_t(keys, start_m, offs_m, T, S, row_hi, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr):
    """visible's transpose, (len(keys), len(offs_m)), for the queries start_m + offs_m: a real key;
    causal, j <= i + S - T; bounded, query i before the key's row_hi (each key's)."""
    visible = keys[:, None] < S
    if CAUSAL:
        visible = visible & (keys[:, None] <= start_m + offs_m[None, :] + (S - T))
    if BOUNDED:
        visible = visible & (start_m + offs_m[None, :] < row_hi[:, None])
    return visible


# --------------------------------------------------------------------------------------------
# tile ranges, in blocks


@gluon.jit
def kv_blocks(KEY_LO, off_b, start_m, T, S, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """(lo, n_blocks, key_lo): the key blocks lo .. n_blocks - 1 that query rows [start_m, start_m +
    BLOCK_M) see: up to the block of the last row's last key, from the block of the first row's
    first key on (bounded); key_lo, the batch row's (KEY_LO: Bounds.key_lo, or None)."""
    key_end = S
    if CAUSAL:  # one past the last key the tile's last row sees (<= 0: its rows see none)
        key_end = gl.minimum(S, start_m + BLOCK_M + S - T)
    n_blocks = gl.cdiv(gl.maximum(key_end, 0), BLOCK_N)
    key_lo = 0  # unbounded: unread
    lo = 0  # bounded, keys before the first row's first key are never loaded
    if BOUNDED:
        key_lo = KEY_LO + off_b.to(gl.int64) * T
        lo = gl.load(key_lo + start_m) // BLOCK_N
    return lo, n_blocks, key_lo


@gluon.jit
def kv_runs(KEY_LO, rows, first, lo, n_blocks, T, S, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr,
            ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """What a consumer of query rows `rows` = first .. first + ROWS - 1 needs of the tile's key
    blocks lo .. n_blocks - 1: (key_lo, each row's first key, for visible; own_lo, full_lo,
    n_full). It passes the blocks before own_lo unread (another consumer's rows see them), masks
    those before full_lo, needs no mask on those before n_full (all keys < S, and (causal) none
    after its first row) and masks the rest."""
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
    return key_lo, own_lo, full_lo, n_full


@gluon.jit
def q_blocks(ROW_HI, off_b, n, T, S, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """(m_lo, m_hi, row_hi, full_hi): the Q blocks m_lo .. m_hi - 1 that see key block n (per
    query head); row_hi, the batch row's (ROW_HI: Bounds.row_hi, or None); full_hi, the first key's
    row_hi: bounded, rows from there on need the mask."""
    m_lo = 0
    if CAUSAL:  # bottom-right: query i sees key j iff j <= i + S - T
        m_lo = gl.maximum(n * BLOCK_N + T - S, 0) // BLOCK_M
    m_hi = gl.cdiv(T, BLOCK_M)
    row_hi = 0  # unbounded: unread
    full_hi = T  # bounded, rows from here on need the mask
    if BOUNDED:  # rows from the last key's row_hi on see none of the keys; row_hi grows with the key
        row_hi = ROW_HI + off_b.to(gl.int64) * S
        m_hi = gl.maximum(gl.cdiv(gl.load(row_hi + gl.minimum(n * BLOCK_N + BLOCK_N, S) - 1), BLOCK_M), m_lo)
        full_hi = gl.load(row_hi + n * BLOCK_N)
    return m_lo, m_hi, row_hi, full_hi


@gluon.jit
def tile_masked(start_m, start_n, past_s, full_hi, T, S, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Whether the backward's tile of query rows start_m.. and keys start_n.. needs the mask: past
    S (past_s), a key that may follow a query (causal), rows that reach full_hi (bounded)."""
    masked = past_s
    if CAUSAL:
        masked = masked | (start_n + BLOCK_N - 1 > start_m + S - T)
    if BOUNDED:
        masked = masked | (start_m + BLOCK_M > full_hi)
    return masked


@gluon.jit
def last_kv_block(start_m, n_blocks, T, S, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The last of n_blocks key blocks that the Q block at start_m sees."""
    n_hi = n_blocks - 1
    if CAUSAL:
        n_hi = gl.minimum(n_hi, (start_m + BLOCK_M - 1 + S - T) // BLOCK_N)
    return n_hi


@gluon.jit
def dq_turn(KEY_LO, start_m, n, n_blocks, T, S, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr,
            LONGEST_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """How many key blocks add their dQ share of the Q block at start_m before key block n does. The
    key blocks that see a Q block are one run: each row sees its keys from key_lo to its diagonal,
    and both grow with the row. Longest first adds from the run's first block (its first row's
    key_lo's) up, in the order those programs launch and reach the Q block; shortest first from its
    last block (the last row's diagonal) down. KEY_LO: the batch row's."""
    if LONGEST_FIRST:
        n_lo = 0
        if BOUNDED:
            n_lo = gl.load(KEY_LO + start_m) // BLOCK_N
        return n - n_lo
    return last_kv_block(start_m, n_blocks, T, S, CAUSAL, BLOCK_M, BLOCK_N) - n


# --------------------------------------------------------------------------------------------
# layouts and descriptors


@gluon.constexpr_function
def dq_layout(block_m, head_dim, num_warps):
    """The (BLOCK_M, D) accumulator's wgmma layout: 16-row slices over 4 warps per 64 rows, the
    remaining warps splitting D."""
    along_m = min(num_warps, block_m // 16)
    along_d = num_warps // along_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_m, along_d],
                                     instr_shape=[16, head_dim // along_d, 16])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.cache
def _tile_layout(block: tuple[int, ...], dtype: torch.dtype, swizzled: bool):
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.itemsize * 8, rank=len(block))
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, block: list[int], swizzled: bool = True) -> TensorDescriptor:
    """A host TMA descriptor over t with this box (rows past an edge read as zeros, writes past it
    dropped), its shared-memory box swizzled for wgmma (or, not swizzled, in plain row order)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _tile_layout(tuple(block), t.dtype, swizzled))
