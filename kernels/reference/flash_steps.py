"""FlashAttention step by step: each step of docs/flash-attention.md computed twice and compared.

A step builds one quantity the way the derivation does (in blocks, online, from LSE) and the
textbook dense way, on small random float64 tensors, and returns the largest absolute difference
(relative, for the float32 kernels) and a note. A correct step agrees to float64 round-off
(~1e-15); a wrong one (a missing rescale, a skipped block that some row sees) is off by O(1) or
gives NaN, and NaN never passes. The last steps run this repository's own code:
kernels/reference/flash_ref.py in float64, and the Triton kernels of kernels/triton/ in float32
through Triton's CPU interpreter. Each step's core is a few lines: change one (the doc ends with
exercises) and rerun. Seconds on a CPU:

    python -m kernels.reference.flash_steps [--seed N]
"""

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels import flash_attention, flash_attn_forward
from kernels.masking import Mask
from kernels.score_mods import ScoreMods
from kernels.reference.flash_ref import (flash_attention_reference_backward, flash_attention_reference_forward,
                                         kv_block_range, q_block_range)

F64 = torch.float64
NEG_INF = float("-inf")
T, S, D, BM, BN = 40, 56, 16, 16, 8  # the steps' sizes: T != S, blocks that divide neither


# --------------------------------------------------------------------------------------------
# the textbook formula, and how a step's error is measured


def dense_attention(q, k, v, mask=None, mods=None, bias=None, sink=None):
    """softmax(Q K^T / sqrt(D)) V and logsumexp of each row, for q (..., T, D), k, v (..., S, D);
    mask (T, S) or broadcastable, True where a query may see a key. mods: a ScoreMods on the
    scaled scores (bias: its ALiBi bias, (T, S)); sink: one head's sink logit, a key of no value."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (..., T, S)
    if mods is not None:
        s = mods.apply(s, bias)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    if sink is not None:
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
    return torch.softmax(s, -1)[..., :v.shape[-2]] @ v, torch.logsumexp(s, -1)


def dense_with_grads(q, k, v, do, mask=None, **extra):
    """(O, LSE, dQ, dK, dV) of dense_attention in float64, the gradients by autograd, for one head
    (q (T, D), k and v (S, D)) or heads (q (..., H, T, D), k and v (..., H_kv, S, D), GQA); with a
    sink (extra: dense_attention's mods, bias and sink), its gradient last."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    leaves = (q, k, v)
    if extra.get("sink") is not None:
        extra["sink"] = extra["sink"].detach().double().requires_grad_()
        leaves += (extra["sink"],)
    k_h, v_h = (k, v) if q.dim() == 2 else (t.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for t in (k, v))
    o, lse = dense_attention(q, k_h, v_h, mask, **extra)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do.double()))


def max_error(*pairs, relative=False):
    """Largest |got - want| over (got, want) pairs (divided by max |want| if relative). One
    tensor max, not Python's max(), so that a NaN anywhere is the result."""
    errors = [(got - want).abs().max() / (want.abs().max() if relative else 1) for got, want in pairs]
    return torch.stack(errors).max().item()


def passes(error, bound):
    return error <= bound  # False for NaN


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


# --------------------------------------------------------------------------------------------
# the blocked algorithm: one head, q (T, D), k and v (S, D); every row sees at least one key


def _scores(q, k, rows, cols, mods, bias):
    """A tile's scaled scores (bm, bn) and, with mods, the modified ones the softmax takes."""
    s = q[rows] @ k[cols].T * q.shape[-1] ** -0.5
    return s, s if mods is None else mods.apply(s, None if bias is None else bias[rows, cols])


def fa2_forward(q, k, v, bm, bn, causal=False, tiles=None, mods=None, bias=None, sink=None):
    """(O, LSE): query blocks outside (one program each in the kernel), key blocks inside, an online
    softmax, one division per row at the end. tiles counts the (query, key) tiles visited. mods,
    bias: a score modification, applied to each tile's scores before the max; sink: a logit each
    row's softmax starts from (m = sink, l = 1: a key of no value seen first)."""
    (T, D), S = q.shape, k.shape[0]
    o, lse = torch.empty_like(q), torch.empty(T, dtype=q.dtype)
    for start_m in range(0, T, bm):
        rows = slice(start_m, min(start_m + bm, T))
        m_i = torch.full((rows.stop - start_m,), NEG_INF, dtype=q.dtype)  # running row max
        l_i = torch.zeros_like(m_i)  # running sum of exp(s - m)
        if sink is not None:
            m_i, l_i = m_i.fill_(sink.item()), l_i.fill_(1.0)
        acc = torch.zeros(len(m_i), D, dtype=q.dtype)  # running sum of exp(s - m) v, unnormalised
        full_end, end = kv_block_range(start_m, bm, bn, T, S, causal)
        for start_n in range(0, end, bn):
            cols = slice(start_n, min(start_n + bn, S))
            _, s = _scores(q, k, rows, cols, mods, bias)  # (bm, bn)
            if causal and start_n >= full_end:  # only tiles that straddle the diagonal are masked
                s = s.masked_fill(~Mask(T, S).dense()[0, 0, rows, cols], NEG_INF)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_sub = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows with no key yet: exp(-inf - 0) = 0, not NaN
            p = torch.exp(s - m_sub[:, None])
            alpha = torch.exp(m_i - m_sub)
            l_i = alpha * l_i + p.sum(-1)
            acc = alpha[:, None] * acc + p @ v[cols]
            m_i = m_new
            if tiles is not None:
                tiles["masked" if start_n >= full_end else "full"] += 1
        o[rows] = acc / l_i[:, None]
        lse[rows] = m_i + torch.log(l_i)
    return o, lse


def fa2_backward(q, k, v, o, lse, do, bm, bn, causal=False, tiles=None, mods=None, bias=None, sink=None):
    """(dQ, dK, dV) by recomputing P from LSE, in two passes that each own their outputs: a dK/dV
    pass (key block resident, query blocks streaming) and a dQ pass (query block resident). With
    mods, dS reaches the scaled scores through the modification's derivative; with a sink, its
    gradient follows as a fourth output: -sum_i P_i,sink delta_i (the sink has no value: dP = 0)."""
    (T, D), S = q.shape, k.shape[0]
    scale = D**-0.5
    delta = (do * o).sum(-1)  # (T,) rowsum(dO * O) = rowsum(P * dP)

    def probs(rows, cols, masked):
        """(P, the factor dS takes on its way back to the scaled scores) of a tile."""
        s, s_mod = _scores(q, k, rows, cols, mods, bias)
        p = torch.exp(s_mod - lse[rows, None])  # (bm, bn)
        p = p.masked_fill(~Mask(T, S).dense()[0, 0, rows, cols], 0.0) if masked and causal else p
        return p, 1.0 if mods is None else mods.derivative(s)

    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start_n in range(0, S, bn):
        cols = slice(start_n, min(start_n + bn, S))
        start, full_start = q_block_range(start_n, bm, bn, T, S, causal)
        for start_m in range(start, T, bm):
            rows = slice(start_m, min(start_m + bm, T))
            p, through = probs(rows, cols, masked=start_m < full_start)  # matmul 1: Q K^T
            dv[cols] += p.T @ do[rows]  # 2
            dp = do[rows] @ v[cols].T  # 3
            ds = p * (dp - delta[rows, None]) * through
            dk[cols] += scale * ds.T @ q[rows]  # 4
            if tiles is not None:
                tiles["dkdv"] += 1

    dq = torch.zeros_like(q)
    for start_m in range(0, T, bm):
        rows = slice(start_m, min(start_m + bm, T))
        full_end, end = kv_block_range(start_m, bm, bn, T, S, causal)
        for start_n in range(0, end, bn):
            cols = slice(start_n, min(start_n + bn, S))
            p, through = probs(rows, cols, masked=start_n >= full_end)  # 5: Q K^T again
            dp = do[rows] @ v[cols].T  # 6: dO V^T again
            ds = p * (dp - delta[rows, None]) * through
            dq[rows] += scale * ds @ k[cols]  # 7
            if tiles is not None:
                tiles["dq"] += 1
    if sink is None:
        return dq, dk, dv
    return dq, dk, dv, -(torch.exp(sink - lse) * delta).sum()


# --------------------------------------------------------------------------------------------
# the steps: each takes a fresh generator and returns (max error, note)


def _head(gen):
    """q (T, D), k, v (S, D) and dO (T, D), float64."""
    return randn(gen, T, D), randn(gen, S, D), randn(gen, S, D), randn(gen, T, D)


def step_online_softmax(gen):
    n, d = 50, 8
    s = randn(gen, n) + torch.arange(n) / 4  # one row of scores; they drift up, so the max moves
    s[:BN] = NEG_INF  # its first key block is hidden from this row (keys of an earlier document)
    v = randn(gen, n, d)
    m_i, l_i, acc = torch.tensor(NEG_INF, dtype=F64), torch.tensor(0.0, dtype=F64), torch.zeros(d, dtype=F64)
    for start_n in range(0, n, BN):
        s_j, v_j = s[start_n:start_n + BN], v[start_n:start_n + BN]
        m_new = torch.maximum(m_i, s_j.max())
        m_sub = 0.0 if m_new == NEG_INF else m_new  # no key seen yet: subtract 0, not -inf
        p = torch.exp(s_j - m_sub)
        alpha = torch.exp(m_i - m_sub)  # rescales what was summed under the old max
        l_i = alpha * l_i + p.sum()
        acc = alpha * acc + p @ v_j
        m_i = m_new
    o, lse = acc / l_i, m_i + torch.log(l_i)
    return max_error((o, torch.softmax(s, 0) @ v), (lse, torch.logsumexp(s, 0))), f"{n} scores in blocks of {BN}"


def step_fa1_forward(gen):
    q, k, v, _ = _head(gen)
    scale = D**-0.5
    o = torch.zeros(T, D, dtype=F64)  # O, m, l live in main memory between visits
    m_i, l_i = torch.full((T,), NEG_INF, dtype=F64), torch.zeros(T, dtype=F64)
    for start_n in range(0, S, BN):  # key/value blocks outside
        k_j, v_j = k[start_n:start_n + BN], v[start_n:start_n + BN]
        for start_m in range(0, T, BM):  # query blocks inside: read O, m, l, update, write back
            rows = slice(start_m, start_m + BM)
            s = scale * q[rows] @ k_j.T
            m_blk = s.amax(-1)
            p = torch.exp(s - m_blk[:, None])
            m_new = torch.maximum(m_i[rows], m_blk)
            old, new = torch.exp(m_i[rows] - m_new), torch.exp(m_blk - m_new)
            l_new = old * l_i[rows] + new * p.sum(-1)
            # undo the old normalisation, add this block, normalise again
            o[rows] = ((old * l_i[rows])[:, None] * o[rows] + new[:, None] * (p @ v_j)) / l_new[:, None]
            m_i[rows], l_i[rows] = m_new, l_new
    return max_error((o, dense_attention(q, k, v)[0])), f"O, m, l read and written {-(-S // BN)} times per row"


def step_fa2_forward(gen):
    q, k, v, _ = _head(gen)
    return max_error(*zip(fa2_forward(q, k, v, BM, BN), dense_attention(q, k, v))), "O and LSE written once per row"


def step_p_from_lse(gen):
    q, k, v, _ = _head(gen)
    _, lse = fa2_forward(q, k, v, BM, BN)
    p = torch.empty(T, S, dtype=F64)
    for start_m in range(0, T, BM):
        for start_n in range(0, S, BN):
            rows, cols = slice(start_m, start_m + BM), slice(start_n, start_n + BN)
            p[rows, cols] = torch.exp(D**-0.5 * q[rows] @ k[cols].T - lse[rows, None])
    p_ref = torch.softmax(D**-0.5 * q @ k.T, -1)
    return max_error((p, p_ref)), f"{T} LSE values stand for {T * S} probabilities"


def step_delta(gen):
    q, k, v, do = _head(gen)
    p = torch.softmax(D**-0.5 * q @ k.T, -1)
    o, dp = p @ v, do @ v.T
    return max_error(((do * o).sum(-1), (p * dp).sum(-1))), "from O and dO alone: no (T, S) matrix"


def step_backward(gen):
    q, k, v, do = _head(gen)
    o, lse = fa2_forward(q, k, v, BM, BN)
    grads = fa2_backward(q, k, v, o, lse, do, BM, BN)
    return max_error(*zip(grads, dense_with_grads(q, k, v, do)[2:])), "7 matmuls per tile pair, no atomics"


def step_causal(gen):
    T_c, S_c, b = 96, 128, 16  # T != S: the diagonal is j = i + 32
    q, k, v, do = randn(gen, T_c, D), randn(gen, S_c, D), randn(gen, S_c, D), randn(gen, T_c, D)
    tiles = Counter()
    o, lse = fa2_forward(q, k, v, b, b, causal=True, tiles=tiles)
    grads = fa2_backward(q, k, v, o, lse, do, b, b, causal=True, tiles=tiles)
    ref = dense_with_grads(q, k, v, do, Mask(T_c, S_c).dense()[0, 0])
    note = (f"forward visits {tiles['full'] + tiles['masked']} of {(T_c // b) * (S_c // b)} tiles, "
            f"{tiles['masked']} masked; dK/dV pass {tiles['dkdv']}, dQ pass {tiles['dq']}")
    return max_error(*zip((o, lse, *grads), ref)), note


def step_gqa(gen):
    H, H_kv = 4, 2
    group = H // H_kv
    q, do = randn(gen, H, T, D), randn(gen, H, T, D)
    k, v = randn(gen, H_kv, S, D), randn(gen, H_kv, S, D)
    o, lse = torch.empty_like(q), torch.empty(H, T, dtype=F64)
    for h in range(H):  # query head h reads kv head h // group
        o[h], lse[h] = fa2_forward(q[h], k[h // group], v[h // group], BM, BN, causal=True)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for h_kv in range(H_kv):
        for g in range(group):  # a kv head's gradient sums its query heads' in this fixed order
            h = h_kv * group + g
            dq[h], dk_h, dv_h = fa2_backward(q[h], k[h_kv], v[h_kv], o[h], lse[h], do[h], BM, BN, causal=True)
            dk[h_kv] += dk_h
            dv[h_kv] += dv_h
    ref = dense_with_grads(q, k, v, do, Mask(T, S).dense()[0, 0])
    return max_error(*zip((o, lse, dq, dk, dv), ref)), f"{H} query heads on {H_kv} kv heads"


def _modified(gen, mods, sink=None):
    """(error, note) of the blocked forward and backward with a score modification (and a sink)
    against autograd through the textbook formula, causal, T != S, head 1 of 4 (ALiBi's slope 1/16).
    Both sides take the same bias: the steps check where the blocks apply it, the tests its values."""
    q, k, v, do = _head(gen)
    bias = ScoreMods.alibi_bias(4, T, S)[1] if mods.alibi else None
    o, lse = fa2_forward(q, k, v, BM, BN, causal=True, mods=mods, bias=bias, sink=sink)
    grads = fa2_backward(q, k, v, o, lse, do, BM, BN, causal=True, mods=mods, bias=bias, sink=sink)
    ref = dense_with_grads(q, k, v, do, Mask(T, S).dense()[0, 0], mods=mods, bias=bias, sink=sink)
    return max_error(*zip((o, lse, *grads), ref)), f"T {T}, S {S}, causal, blocks of {BM} x {BN}"


def step_softcap(gen):
    return _modified(gen, ScoreMods(softcap=1.5))


def step_alibi(gen):
    return _modified(gen, ScoreMods(alibi=True))


def step_sinks(gen):
    sink = 0.5 + 0.1 * randn(gen, 1)[0]  # a real share of each row, and the row's max still moves past it
    return _modified(gen, ScoreMods(softcap=2.0, alibi=True), sink)


def _heads(gen, B, H, H_kv, dtype):
    """q (B, H, T, D), k, v (B, H_kv, S, D) and dO."""
    q, do = randn(gen, B, H, T, D, dtype=dtype), randn(gen, B, H, T, D, dtype=dtype)
    return q, randn(gen, B, H_kv, S, D, dtype=dtype), randn(gen, B, H_kv, S, D, dtype=dtype), do


def step_flash_ref(gen):
    q, k, v, do = _heads(gen, 2, 4, 2, F64)
    o, lse = flash_attention_reference_forward(q, k, v, causal=True, block_m=BM, block_n=BN)
    grads = flash_attention_reference_backward(q, k, v, o, lse, do, causal=True, block_m=BM, block_n=BN)
    ref = dense_with_grads(q, k, v, do, Mask(T, S).dense()[0, 0])
    return max_error(*zip((o, lse, *grads), ref)), f"B 2, H 4, H_kv 2, T {T}, S {S}, causal"


# The kernels compute in float32 (unit round-off 6e-8). Their sums run over at most ~100 terms
# (the keys of a row; the rows of a key across a GQA group), whose round-off grows like
# sqrt(n) eps: under 1e-6 of the largest term; exp, log and the backward's dP - delta add a few
# times that. 1e-4 of each
# output's largest value leaves ~100x of headroom, and every algorithmic error (a wrong mask, a
# missing rescale, a lost block) is O(1) relative. The interpreter is slow: T and S stay <= 64.
F32_RELATIVE_BOUND = 1e-4


def _triton_error(q, k, v, do, mask, doc_ids=None):
    """Largest relative error of flash_attention's O, LSE, dQ, dK, dV (float32) against float64."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal=True, doc_ids=doc_ids)
    grads = torch.autograd.grad(o, (q, k, v), do)
    _, lse = flash_attn_forward(q.detach(), k.detach(), v.detach(), causal=True, doc_ids=doc_ids)
    return max_error(*zip((o, lse, *grads), dense_with_grads(q, k, v, do, mask)), relative=True)


def step_triton(gen):
    q, k, v, do = _heads(gen, 1, 4, 2, torch.float32)
    return _triton_error(q, k, v, do, Mask(T, S).dense()[0, 0]), "float32 in Triton's interpreter; relative error"


def step_triton_documents(gen):
    lengths = (5, 20, 3, 36)  # a document inside one tile; others across tile boundaries
    T_d = sum(lengths)
    q, k, v, do = (randn(gen, 1, 2, T_d, D, dtype=torch.float32) for _ in range(4))
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # (1, T_d)
    mask = Mask(T_d, T_d, True, doc_ids).dense()  # (1, 1, T_d, T_d)
    return _triton_error(q, k, v, do, mask, doc_ids), f"documents of {', '.join(map(str, lengths))} tokens"


# --------------------------------------------------------------------------------------------
# the table


class Step(NamedTuple):
    name: str
    checks: str
    run: Callable[[torch.Generator], tuple[float, str]]
    bound: float


F64_BOUND = 1e-12  # float64 round-off on these sizes is ~1e-15; any algorithmic error is O(1)
STEPS = [
    Step("online_softmax", "one row in blocks: running max, sum = softmax(s) v, LSE", step_online_softmax, F64_BOUND),
    Step("fa1_forward", "K/V outer, normalise every block = dense O", step_fa1_forward, F64_BOUND),
    Step("fa2_forward", "Q outer, one division, LSE = dense O, LSE", step_fa2_forward, F64_BOUND),
    Step("p_from_lse", "exp(S - LSE) tile by tile = softmax(S)", step_p_from_lse, F64_BOUND),
    Step("delta", "rowsum(dO * O) = rowsum(P * dP)", step_delta, F64_BOUND),
    Step("backward", "dK/dV pass + dQ pass = autograd dQ, dK, dV", step_backward, F64_BOUND),
    Step("causal", "T != S, skipped and masked tiles = dense causal", step_causal, F64_BOUND),
    Step("gqa", "query heads share kv heads, dK, dV summed = dense", step_gqa, F64_BOUND),
    Step("softcap", "C tanh(s / C) before the max; dS times 1 - tanh^2 = dense", step_softcap, F64_BOUND),
    Step("alibi", "-slope |j - i'| added before the max = dense, causal T != S", step_alibi, F64_BOUND),
    Step("sinks", "m = sink, l = 1 to start; dsink = -sum P_sink delta = dense", step_sinks, F64_BOUND),
    Step("flash_ref", "kernels.reference.flash_ref forward + backward = dense", step_flash_ref, F64_BOUND),
    Step("triton", "kernels.triton (fp32) vs float64 dense", step_triton, F32_RELATIVE_BOUND),
    Step("triton_documents", "the same, packed documents", step_triton_documents, F32_RELATIVE_BOUND),
]


def run_step(step, seed):
    """(error, note) of one step on a fresh generator."""
    return step.run(torch.Generator().manual_seed(seed))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Check each step of docs/flash-attention.md numerically.")
    parser.add_argument("--seed", type=int, default=0, help="seed of every step's random inputs (default 0)")
    seed = parser.parse_args(argv).seed
    results = [(step, *run_step(step, seed)) for step in STEPS]
    name_w, checks_w = max(len(s.name) for s in STEPS), max(len(s.checks) for s in STEPS)
    print(f"{'step':<{name_w}}  {'checks':<{checks_w}}  {'error':>9}  {'bound':>7}  result")
    for step, error, _ in results:
        verdict = "pass" if passes(error, step.bound) else "FAIL"
        print(f"{step.name:<{name_w}}  {step.checks:<{checks_w}}  {error:9.2e}  {step.bound:7.0e}  {verdict}")
    print()
    for step, _, note in results:
        print(f"{step.name}: {note}")
    return 0 if all(passes(error, step.bound) for step, error, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
