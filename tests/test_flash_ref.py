"""The plain-PyTorch references in kernels/reference/flash_ref.py are right, so the kernel tests can trust them.

Proves that (1) the dense float64 `attention_reference`, with its explicit bottom-right causal
mask, agrees with torch's own scaled_dot_product_attention given the same mask, and with
is_causal when T == S; (2) the tiled FlashAttention-2 reference (online softmax, LSE
recomputation, the unmasked/masked block split and causal block skipping that the Triton
kernels copy) reproduces the dense float64 attention and its gradients to float64 rounding,
for block sizes that divide the sequences or not, BLOCK_M above, equal to or below BLOCK_N,
T < S, T == S and T > S (rows that see no key), GQA. An error in the block arithmetic (a
skipped block that some row sees, an unmasked block that needed the mask) shows up as an O(1)
difference here; (3) the reference's score modifications and sinks (kernels/score_mods.py) are
their formulas, and off they change nothing. Pure PyTorch on CPU, a few seconds:

    .venv/bin/python -m pytest tests/test_flash_ref.py -q
"""

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from kernels.reference.flash_ref import (
    attention_probs,
    attention_reference,
    flash_attention_reference_backward,
    flash_attention_reference_forward,
)
from kernels.score_mods import ScoreMods, alibi_slopes

# float64 throughout: agreement is to rounding, ~1e-15 relative
TOL = 1e-10


def _inputs(case_id, B, H, H_kv, T, S, D):
    gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=gen, dtype=torch.float64)
    do = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    return q, k, v, do


def _dense_with_grads(q, k, v, do, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(q, k, v, causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return (o.detach(), lse, *grads)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("T", "S"), [(1, 1), (17, 17), (13, 40), (40, 13), (64, 64)])
def test_dense_reference_matches_sdpa(T, S, causal):
    B, H, H_kv, D = 2, 4, 2, 16
    q, k, v, do = _inputs(f"sdpa-{T}-{S}-{causal}", B, H, H_kv, T, S, D)
    ref = _dense_with_grads(q, k, v, do, causal)

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if causal and T == S:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        # bottom-right aligned mask; rows that see no key are compared separately below
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    seen = torch.arange(T) + (S - T) >= 0 if causal else torch.ones(T, dtype=torch.bool)  # rows with >= 1 key
    assert (ref[0][:, :, seen] - o[:, :, seen]).abs().max() < TOL
    if seen.all():  # SDPA's gradients are NaN when some row sees no key
        grads = torch.autograd.grad(o, (q, k, v), do)
        for got, want in zip(ref[2:], grads, strict=True):
            assert (got - want).abs().max() < TOL
    # rows that see no key: zero output, -inf LSE (SDPA returns NaN there)
    assert (ref[0][:, :, ~seen] == 0).all()
    assert torch.isinf(ref[1][:, :, ~seen]).all() and torch.isfinite(ref[1][:, :, seen]).all()


BLOCKS = [(16, 16), (16, 32), (32, 16), (64, 64), (7, 5)]
SHAPES = [(1, 1), (17, 17), (17, 100), (100, 17), (64, 129), (129, 64), (129, 129)]
# every shape with every block pair, causal and not; the GQA group size rotates through 1, 2, 4
CASES = [
    (T, S, causal, (4, 2, 1)[i % 3], bm, bn)
    for i, ((T, S), causal, (bm, bn)) in enumerate(itertools.product(SHAPES, [True, False], BLOCKS))
]


@pytest.mark.parametrize(("T", "S", "causal", "H_kv", "block_m", "block_n"), CASES)
def test_tiled_reference_matches_dense(T, S, causal, H_kv, block_m, block_n):
    B, H, D = 1, 4, 8
    case_id = f"tiled-{T}-{S}-{causal}-{H_kv}-{block_m}-{block_n}"
    q, k, v, do = _inputs(case_id, B, H, H_kv, T, S, D)
    o_ref, lse_ref, *grads_ref = _dense_with_grads(q, k, v, do, causal)

    o, lse = flash_attention_reference_forward(q, k, v, causal, None, block_m, block_n)
    grads = flash_attention_reference_backward(q, k, v, o, lse, do, causal, None, block_m, block_n)

    assert (o - o_ref).abs().max() < TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # the same rows see no key
    finite = torch.isfinite(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max() < TOL
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert torch.isfinite(got).all(), name
        assert (got - want).abs().max() < TOL, name


# --------------------------------------------------------------------------------------------
# the ablations' score modifications and sinks (kernels/score_mods.py), in the reference


def _papers_slopes(n):
    """The ALiBi paper's get_slopes, as published."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _papers_slopes(2 * closest)[0::2][:n - closest]


def test_alibi_slopes_are_the_papers():
    for n in range(1, 65):
        torch.testing.assert_close(alibi_slopes(n), torch.tensor(_papers_slopes(n), dtype=torch.float64))
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    with pytest.raises(ValueError, match=r"^alibi_slopes: n_heads=0: need at least one head$"):
        alibi_slopes(0)


def test_alibi_bias_is_minus_slope_times_distance_bottom_right():
    bias = ScoreMods.alibi_bias(8, 2, 3)  # 2 queries at key positions 1 and 2 (T < S)
    assert bias[0].tolist() == [[-0.5, 0.0, -0.5], [-1.0, -0.5, 0.0]]
    assert bias[3].tolist() == [[-0.0625, 0.0, -0.0625], [-0.125, -0.0625, 0.0]]


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), None, True])
def test_a_bad_modification_is_one_line(softcap):
    with pytest.raises(ValueError, match=rf"^softcap={softcap}: a cap is a finite number > 0, or 0 for none$"):
        ScoreMods(softcap=softcap)
    with pytest.raises(ValueError, match=r"^alibi=1: true or false$"):
        ScoreMods(alibi=1)


def test_no_modification_is_the_plain_reference_bit_for_bit():
    q, k, v = torch.randn(3, 2, 3, 9, 16, dtype=torch.float64).unbind(0)
    assert not ScoreMods() and ScoreMods(alibi=True) and ScoreMods(softcap=2)
    for got, want in zip(attention_reference(q, k, v, mods=ScoreMods()), attention_reference(q, k, v)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("T, S", [(6, 6), (4, 7)])
def test_modified_scores_are_the_formula(T, S):
    # softcap, then ALiBi's -slope |j - i'| written out here (4 heads: slopes 1/4 .. 1/256)
    q, k = torch.randn(1, 4, T, 8, dtype=torch.float64), torch.randn(1, 4, S, 8, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) * 8 ** -0.5
    i, j = torch.arange(T)[:, None] + S - T, torch.arange(S)[None, :]
    slopes = torch.tensor([4.0 ** -(h + 1) for h in range(4)], dtype=torch.float64)[:, None, None]
    s = 0.7 * torch.tanh(s / 0.7) - slopes * (j - i).abs()
    s = s.masked_fill(j > i, float("-inf"))
    p, lse = attention_probs(q, k, mods=ScoreMods(softcap=0.7, alibi=True))
    torch.testing.assert_close(p, torch.softmax(s, -1), rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-14)


def test_a_sink_takes_its_share_and_a_row_that_sees_no_key_gives_it_all():
    # causal, T > S: the first T - S rows see no key; each row's weights sum to 1 - P_sink
    q, k, v = torch.randn(1, 2, 7, 8, dtype=torch.float64), *torch.randn(2, 1, 2, 4, 8, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    p, lse = attention_probs(q, k, sinks=sinks)
    torch.testing.assert_close(p.sum(-1), 1 - torch.exp(sinks[None, :, None] - lse), rtol=0, atol=1e-14)
    o, lse = attention_reference(q, k, v, sinks=sinks)
    assert (o[:, :, :3] == 0).all() and torch.equal(lse[:, :, :3], sinks.detach()[None, :, None].expand(1, 2, 3))
    do = torch.randn_like(o)
    dq, dk, dv, dsinks = torch.autograd.grad((o * do).sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv, dsinks)) and (dq[:, :, :3] == 0).all()
    delta = (do * o).sum(-1)  # the sink's gradient from the LSE and delta alone
    torch.testing.assert_close(dsinks, -(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2)).detach(),
                               rtol=0, atol=1e-13)
