"""The softmax of the Hopper kernels, on wgmma accumulators in registers. The forward's online
softmax: a key block's scores masked where the tile needs it, the new row maximum, P, the factor
alpha that rescales what the rows summed so far, and P handed to P V as the register A operand
(FlashAttention-3 keeps P in registers, never in shared memory). The backward's P^T, recomputed
from the forward's LSE, one column half of a 128-query step at a time. docs/flash-attention.md
derives both."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.hopper.blocks import visible, visible_t

# --------------------------------------------------------------------------------------------
# the forward


@gluon.jit
def online_softmax(qk, j, m_i, l_i, rows, cols, key_lo, program, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                   BOUNDED: gl.constexpr):
    """Key block j's scores qk (ROWS, BLOCK_N) of the program's tile through the online softmax:
    (P, alpha, l_i, m_new)."""
    BLOCK_N: gl.constexpr = qk.type.shape[1]
    T, S, qk_scale = program.T, program.S, program.qk_scale
    if MASKED:
        qk = gl.where(visible(rows, j * BLOCK_N + cols, T, S, key_lo, CAUSAL, BOUNDED), qk, float("-inf"))
    # -- new row max, rescale --
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_sub = m_new
    if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def p_operand(p, acc, dtype: gl.constexpr):
    """P (ROWS, BLOCK_N) fp32 as the register A operand of P V into acc."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2))


@gluon.jit
def rescale(acc, alpha):
    """acc (ROWS, D), each row times its alpha (ROWS,): what it summed under the old maximum."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


# --------------------------------------------------------------------------------------------
# the backward


@gluon.jit
def column_halves(x):
    """x (R, 2 H) as its columns [0, H) and [H, 2 H), no data moved: a wgmma accumulator thread
    holds columns of both halves."""
    R: gl.constexpr = x.shape[0]
    H: gl.constexpr = x.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(x, [R, 2, H]), [0, 2, 1]))


@gluon.jit
def probs_t(st, lse, start_m, FIRST: gl.constexpr, cols_t, row_hi, masked, qk_scale, T, S, CAUSAL: gl.constexpr,
            BOUNDED: gl.constexpr):
    """P^T = exp2(S^T * softmax_scale * log2(e) - LSE * log2(e)) for one column half of a 128-query
    step: S^T (keys cols_t, queries start_m + FIRST..), lse its queries' LSE * log2(e). Where the
    tile is masked, keys a query does not see get 0; the queries' offsets are made only there (held
    across the loop, they spill). Queries past T arrive as zero Q and dO with LSE = delta = 0:
    P = 1 there, but dP = dS = 0 and dO = 0."""
    pt = gl.exp2(st * qk_scale - lse[None, :])
    if masked:  # selected after exp2: a query with LSE = -inf (it sees no key) is dropped, never NaN
        key_layout: gl.constexpr = gl.SliceLayout(1, st.type.layout)
        offs_m = FIRST + gl.arange(0, st.shape[1], layout=gl.SliceLayout(0, st.type.layout))
        pt = gl.where(visible_t(gl.convert_layout(cols_t, key_layout), start_m, offs_m, T, S,
                                gl.convert_layout(row_hi, key_layout), CAUSAL, BOUNDED), pt, 0.0)
    return pt
