"""FlashAttention-2 in plain PyTorch: the executable specification of kernels/triton/.

Same algorithm, conventions and block logic as the Triton kernels, written for reading and
stepping through, not for speed:
- the forward walks key blocks with an online softmax (running max m, running sum l, one
  rescale of the accumulator per block, one division at the end) and returns O and the
  natural-log LSE; rows that attend no key get O = 0 and LSE = -inf;
- the backward recomputes P = exp(scale * QK^T - LSE) block by block: a dK/dV pass (key block
  resident, query blocks streaming, the query heads of a kv group summed in order) and a dQ
  pass (query block resident, key blocks streaming);
- causal is bottom-right aligned: query i attends key j iff j <= i + S - T; blocks that no row
  attends are skipped and the mask is applied only to blocks that straddle the diagonal or the
  end of the keys, as `kv_block_range` / `q_block_range` do in kernels/triton/blocks.py.
Differences from the kernels: natural exp instead of exp2, Python loops over blocks, all heads
and batches at once. Matmul inputs are rounded to the input dtype and accumulated in fp32 (or
float64 for float64 inputs), like tensor cores do.

`attention_reference` (and `attention_probs`) is plain dense attention with an explicit mask,
float64 by default, that the tests compare both implementations against; it takes the ablations'
score modifications and sinks too (kernels/score_mods.py).
"""

import torch

from kernels.masking import Mask


def kv_block_range(start_m, block_m, block_n, T, S, causal):
    """(full_end, end): query rows [start_m, start_m + block_m) attend keys [0, end); keys below
    full_end, a multiple of block_n, are seen by every one of those rows."""
    if not causal:
        return S // block_n * block_n, S
    full_end = max(min(start_m + S - T + 1, S), 0) // block_n * block_n  # keys the first row sees, whole blocks
    end = max(min(start_m + block_m + S - T, S), 0)  # keys the last row sees
    return full_end, end


def q_block_range(start_n, block_m, block_n, T, S, causal):
    """(start, full_start): query rows [start, T) attend keys [start_n, start_n + block_n); rows
    from full_start on (a multiple of block_m, or T) see every one of those keys."""
    if not causal:
        return 0, 0
    start = max(start_n - (S - T), 0) // block_m * block_m  # the first row that sees the first key, its block
    first_full_row = max(start_n + block_n - 1 - (S - T), 0)  # the first row that sees the last key
    return start, min(-(-first_full_row // block_m) * block_m, T)


def _acc_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _expand_kv(k, H):
    """(B, H_kv, S, D) -> (B, H, S, D): query head h reads kv head h // (H // H_kv)."""
    return k.repeat_interleave(H // k.shape[1], dim=1)


def flash_attention_reference_forward(q, k, v, causal=True, scale=None, block_m=64, block_n=64):
    """Tiled forward: (o in q's dtype, lse (B, H, T) natural log in fp32 or float64)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    acc_dtype = _acc_dtype(q)
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), dtype=acc_dtype, device=q.device)
    for start_m in range(0, T, block_m):
        rows = torch.arange(start_m, min(start_m + block_m, T), device=q.device)
        q_blk = q[:, :, rows].to(acc_dtype)  # (B, H, bm, D)
        m_i = torch.full((B, H, len(rows)), float("-inf"), dtype=acc_dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_blk)
        full_end, end = kv_block_range(start_m, block_m, block_n, T, S, causal)
        for start_n in range(0, end, block_n):
            cols = torch.arange(start_n, min(start_n + block_n, S), device=q.device)
            s = scale * q_blk @ k[:, :, cols].to(acc_dtype).transpose(-1, -2)  # (B, H, bm, bn)
            if start_n >= full_end and causal:
                s = s.masked_fill(~Mask(T, S).sees(None, rows[:, None], cols[None, :]), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no key yet: no NaN
            p = torch.exp(s - m_sub[..., None])
            alpha = torch.exp(m_i - m_sub)
            l_i = alpha * l_i + p.sum(-1)
            acc = alpha[..., None] * acc + p.to(q.dtype).to(acc_dtype) @ v[:, :, cols].to(acc_dtype)
            m_i = m_new
        l_safe = l_i.masked_fill(l_i == 0, 1.0)
        o[:, :, rows] = (acc / l_safe[..., None]).to(q.dtype)
        lse[:, :, rows] = m_i + torch.log(l_safe)
    return o, lse


def flash_attention_reference_backward(q, k, v, o, lse, do, causal=True, scale=None, block_m=64, block_n=64):
    """Tiled backward by recomputation from LSE: (dq, dk, dv) in the dtypes of q, k, v."""
    B, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    acc_dtype = _acc_dtype(q)
    # matmul operands: rounded to the input dtype, multiplied in acc_dtype (as tensor cores do)
    up = lambda x: x.to(acc_dtype)
    low = lambda x: x.to(q.dtype).to(acc_dtype)
    delta = (up(do) * up(o)).sum(-1)  # (B, H, T)
    k_h, v_h = _expand_kv(k, H), _expand_kv(v, H)

    def probs(rows, cols, masked):
        s = scale * up(q[:, :, rows]) @ up(k_h[:, :, cols]).transpose(-1, -2)
        p = torch.exp(s - lse[:, :, rows, None])
        if masked and causal:  # selected after exp: rows with LSE = -inf give inf here and are dropped
            p = torch.where(Mask(T, S).sees(None, rows[:, None], cols[None, :]), p, 0.0)
        return p  # (B, H, bm, bn)

    dk_h = torch.zeros((B, H, S, D), dtype=acc_dtype, device=q.device)  # per query head
    dv_h = torch.zeros_like(dk_h)
    for start_n in range(0, S, block_n):
        cols = torch.arange(start_n, min(start_n + block_n, S), device=q.device)
        start, full_start = q_block_range(start_n, block_m, block_n, T, S, causal)
        for start_m in range(start, T, block_m):
            rows = torch.arange(start_m, min(start_m + block_m, T), device=q.device)
            p = probs(rows, cols, masked=start_m < full_start)
            dv_h[:, :, cols] += low(p).transpose(-1, -2) @ up(do[:, :, rows])
            dp = up(do[:, :, rows]) @ up(v_h[:, :, cols]).transpose(-1, -2)
            ds = p * (dp - delta[:, :, rows, None])
            dk_h[:, :, cols] += low(ds).transpose(-1, -2) @ up(q[:, :, rows])
    # GQA: each kv head's gradient is the sum over its group of query heads
    dk = (scale * dk_h).view(B, H_kv, H // H_kv, S, D).sum(2)
    dv = dv_h.view(B, H_kv, H // H_kv, S, D).sum(2)

    dq = torch.zeros((B, H, T, D), dtype=acc_dtype, device=q.device)
    for start_m in range(0, T, block_m):
        rows = torch.arange(start_m, min(start_m + block_m, T), device=q.device)
        full_end, end = kv_block_range(start_m, block_m, block_n, T, S, causal)
        for start_n in range(0, end, block_n):
            cols = torch.arange(start_n, min(start_n + block_n, S), device=q.device)
            p = probs(rows, cols, masked=start_n >= full_end)
            dp = up(do[:, :, rows]) @ up(v_h[:, :, cols]).transpose(-1, -2)
            ds = p * (dp - delta[:, :, rows, None])
            dq[:, :, rows] += low(ds) @ up(k_h[:, :, cols])
    return (scale * dq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_probs(q, k, causal=True, scale=None, dtype=torch.float64, doc_ids=None, window=0, mods=None,
                    sinks=None, prefix=0):
    """Dense softmax probabilities P (B, H, T, S) with an explicit mask, every op in `dtype`,
    and the natural-log LSE (B, H, T). Differentiable. Rows that attend no key get P = 0 and
    LSE = -inf. doc_ids (B, T), with T == S: query i attends key j only if both ids match.
    window W > 0: query i attends only keys j > i + S - T - W (its last W, with causal).
    prefix P > 0: every query attends its document's (the sequence's) first P keys too, within its window.
    mods: kernels/score_mods.py's ScoreMods, applied to the scaled scores before the mask. sinks
    (H,): each head's sink logit, in every row's denominator (LSE includes it; P's rows then sum
    to less than 1, and a row that sees no key has LSE = its sink)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    s = scale * q.to(dtype) @ _expand_kv(k, H).to(dtype).transpose(-1, -2)  # (B, H, T, S)
    if mods:
        s = mods.apply(s)
    s = s.masked_fill(~Mask(T, S, causal, doc_ids, window, prefix).dense(q.device), float("-inf"))
    if sinks is not None:  # one more logit per row, of a key with no value
        s = torch.cat([s, sinks.to(dtype)[None, :, None, None].expand(B, H, T, 1)], dim=-1)
    lse = torch.logsumexp(s.detach(), dim=-1)
    empty = torch.isinf(lse)[..., None]  # softmax of an all -inf row is NaN: give it zeros instead
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p[..., :S], lse


def attention_reference(q, k, v, causal=True, scale=None, dtype=torch.float64, doc_ids=None, window=0, mods=None,
                        sinks=None, prefix=0):
    """Dense attention with an explicit mask, every op in `dtype`: (o, LSE in natural log).
    Differentiable; rows that attend no key give o = 0, LSE = -inf (or their sink) and zero
    gradients. mods, sinks, prefix: as attention_probs'."""
    p, lse = attention_probs(q, k, causal, scale, dtype, doc_ids, window, mods, sinks, prefix)
    return p @ _expand_kv(v, q.shape[1]).to(dtype), lse
