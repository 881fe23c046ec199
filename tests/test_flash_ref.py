"""The plain-PyTorch references in kernels/reference/flash_ref.py are right, so the kernel tests can trust them.

Proves that (1) the dense float64 `attention_reference`, with its explicit bottom-right causal
mask, agrees with torch's own scaled_dot_product_attention given the same mask, and with
is_causal when T == S; (2) the tiled FlashAttention-2 reference (online softmax, LSE
recomputation, the unmasked/masked block split and causal block skipping that the Triton
kernels copy) reproduces the dense float64 attention and its gradients to float64 rounding,
for block sizes that divide the sequences or not, BLOCK_M above, equal to or below BLOCK_N,
T < S, T == S and T > S (rows that see no key), GQA. An error in the block arithmetic (a
skipped block that some row sees, an unmasked block that needed the mask) shows up as an O(1)
difference here. Pure PyTorch on CPU, a few seconds:

    .venv/bin/python -m pytest tests/test_flash_ref.py -q
"""

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

from kernels.reference.flash_ref import (
    attention_reference,
    flash_attention_reference_backward,
    flash_attention_reference_forward,
)

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
