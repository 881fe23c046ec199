"""Our kernels' score modifications and sinks (kernels/score_mods.py) compute attention and every
gradient, dsinks included: the portable kernels take them all, the Hopper kernels the sinks.

Proves, for O, LSE, dQ, dK, dV and the sinks' gradient, against the dense float64 reference
(kernels/reference/flash_ref.py's attention_reference, which takes the same ScoreMods and sinks),
that the kernels' error is within tests/helpers.py's bound: twice PyTorch's own dense
attention in the input dtype, plus a floor for rounding and fp32 sums. A softcap, ALiBi and sinks,
alone and together, causal with T == S, T < S and T > S (rows that see no key: with a sink, O = 0
and LSE = the sink), not causal, packed documents, a sliding window, GQA. Also: off (None, or a
ScoreMods with nothing on) is the same bits as no argument; the backward is bit-identical run to
run; autograd (eager and torch.compile) gives the same bits as the two halves; bad arguments and
backend="gluon" with a softcap or ALiBi (which the Hopper kernels do not take) raise one line; a
launch is kept per modification, and bound wherever its absent operands sit.

On CPU the kernels run in Triton's interpreter on small shapes that span several of its 16- and
32-row tiles (bf16 computed in fp32); under a minute on 2 cores. The test_gpu_* tests (skipped
without CUDA) run bf16 and fp16 up to T = 2048 at D 64 and 128, and the Hopper kernels' sinks:

    .venv/bin/python -m pytest tests/test_score_mods_kernels.py -q
"""

import functools
import math
import re
import zlib

import pytest
import torch

import kernels
from kernels import api, backends
from kernels.reference.flash_ref import attention_probs, attention_reference
from kernels.score_mods import ScoreMods
from kernels.triton import fwd
from tests.helpers import assert_within_reference_error, doc_ids_of, make_inputs

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
OFF, CAP, ALIBI, ALL = ScoreMods(), ScoreMods(softcap=2.0), ScoreMods(alibi=True), ScoreMods(softcap=1.5, alibi=True)
NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks")

flash_attention = functools.partial(kernels.flash_attention, backend="triton")
flash_attn_forward = functools.partial(kernels.flash_attn_forward, backend="triton")
flash_attn_backward = functools.partial(kernels.flash_attn_backward, backend="triton")


# --------------------------------------------------------------------------------------------
# helpers


def _sinks(case_id, H, S, device="cpu"):
    """(H,) fp32 sink logits about a row's LSE (log S + 1/2 for these random inputs) less 1.5: each
    takes a real share of its rows."""
    gen = torch.Generator().manual_seed(zlib.crc32(("sinks-" + case_id).encode()))
    return (math.log(S) - 1.0 + torch.randn(H, generator=gen)).to(device).requires_grad_()


def _dense(q, k, v, do, sinks, dtype, **masks_and_mods):
    """(o, lse, dq, dk, dv[, dsinks]) of the dense reference with every op in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    o, lse = attention_reference(*leaves, dtype=dtype, sinks=s, **masks_and_mods)
    return (o.detach(), lse, *torch.autograd.grad(o, leaves + ([] if s is None else [s]), do.to(dtype)))


def _error_scales(q, k, v, do, sinks, causal, doc_ids, window, mods, prefix=0):
    """As tests/helpers.py's error_scales (each output's sums with every factor's absolute
    value, whose size sets their rounding error), with the modifications, and the sinks' gradient
    sum_{b,i} P_sink |delta|. The cap's derivative (at most 1) is left out: a bound."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    B, H, _, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    s64 = None if sinks is None else sinks.detach().double()
    p, lse = attention_probs(q, k, causal, doc_ids=doc_ids, window=window, mods=mods, sinks=s64, prefix=prefix)
    k_h, v_h = (t.repeat_interleave(H // H_kv, dim=1).abs() for t in (k, v))
    o = p @ v_h
    delta = (do.abs() * o).sum(-1)
    ds = p * (do.abs() @ v_h.transpose(-1, -2) + delta[..., None])
    dq = D**-0.5 * ds @ k_h
    dk = D**-0.5 * (ds.transpose(-1, -2) @ q.abs()).view(B, H_kv, H // H_kv, S, D).sum(2)
    dv = (p.transpose(-1, -2) @ do.abs()).view(B, H_kv, H // H_kv, S, D).sum(2)
    dsinks = (torch.exp(s64[None, :, None] - lse) * delta).sum((0, 2)) if s64 is not None else torch.zeros(0)
    lse = lse[torch.isfinite(lse)].abs()
    return tuple(t.max().item() if t.numel() else 0.0 for t in (o, lse, dq, dk, dv, dsinks))


def _check(case_id, dtype, B, H, H_kv, T, S, D, causal, mods, sinks_on, layout="bthd", doc_ids=None, window=0,
           device="cpu", backend="auto", prefix=0):
    """The two halves' O, LSE, dQ, dK, dV (and dsinks) against the float64 reference, each within
    its bound; returns them."""
    q, k, v, do = make_inputs(case_id, B, H, H_kv, T, S, D, dtype, layout, device)
    q, k, v = (t.detach() for t in (q, k, v))
    sinks = _sinks(case_id, H, S, device) if sinks_on else None
    masks_and_mods = dict(causal=causal, doc_ids=doc_ids, window=window, mods=mods, prefix=prefix)
    o, lse = flash_attn_forward(q, k, v, sinks=sinks, backend=backend, **masks_and_mods)
    grads = flash_attn_backward(do, q, k, v, o, lse, sinks=sinks, backend=backend, **masks_and_mods)
    got = (o, lse, *grads)
    assert len(grads) == (4 if sinks_on else 3)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads[:3]) and lse.dtype == F32
    if sinks_on:
        assert grads[3].dtype == sinks.dtype and grads[3].shape == sinks.shape
    ref64 = _dense(q, k, v, do, sinks, torch.float64, **masks_and_mods)
    ref_lowp = _dense(q, k, v, do, sinks, dtype, **masks_and_mods)
    scales = _error_scales(q, k, v, do, sinks, causal, doc_ids, window, mods, prefix)
    # fp32 sums: over the keys for O, LSE and dQ; over the GQA group's queries for dK and dV; over
    # the batch's rows for dsinks
    n_terms = (S, S, S, T * H // H_kv, T * H // H_kv, B * T)
    for name, g, want, lowp, n, scale in zip(NAMES, got, ref64, ref_lowp, n_terms, scales):
        assert_within_reference_error(name, g, want, lowp, dtype, n, scale)
    return got


# --------------------------------------------------------------------------------------------
# correctness on CPU (interpreter): T, S, D span several 16- and 32-row tiles and divide none

# (dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, document lengths or None, window)
CPU_CASES = [
    (F32, 1, 4, 2, 37, 50, 24, True, CAP, False, "bthd", None, 0),
    (F16, 1, 4, 4, 37, 37, 24, True, CAP, False, "packed", None, 0),
    (F32, 1, 4, 2, 37, 50, 24, False, ALIBI, False, "contiguous", None, 0),
    (F16, 1, 4, 2, 50, 37, 24, True, ALIBI, False, "bthd", None, 0),
    (F32, 1, 4, 2, 37, 37, 24, True, OFF, True, "bthd", None, 0),
    (F16, 1, 4, 1, 37, 50, 24, False, OFF, True, "contiguous", None, 0),
    (F32, 1, 4, 2, 37, 50, 24, True, ALL, True, "bthd", None, 0),
    (F16, 1, 4, 2, 50, 37, 24, True, ALL, True, "bthd", None, 0),
    (BF16, 1, 4, 2, 37, 50, 24, False, ALL, True, "bthd", None, 0),
    (F32, 2, 4, 2, 50, 50, 24, True, ALL, True, "bthd", [[1, 20, 29], [50]], 0),
    (F16, 1, 4, 2, 50, 50, 16, True, ALL, True, "packed", None, 13),
    (F32, 1, 4, 2, 50, 50, 24, True, ALL, True, "bthd", [[17, 33]], 9),
]


def _case_id(case):
    dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, lengths, window = case
    on = [name for name, value in (("cap", mods.softcap), ("alibi", mods.alibi), ("sinks", sinks)) if value]
    masks = ("causal" if causal else "full") + (f"-docs{lengths}" if lengths else "")
    masks += f"-W{window}" if window else ""
    return f"{str(dtype)[6:]}-{'+'.join(on)}-H{H}kv{H_kv}-T{T}S{S}-D{D}-{masks}-{layout}"


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, lengths, window = case
    doc_ids = None if lengths is None else doc_ids_of(lengths)
    _check(_case_id(case), dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, doc_ids, window)


# a prefix-LM's prefix: (dtype, B, H, H_kv, T, S, D, mods, sinks, document lengths or None, window,
# prefix); longer than a document, past a window, T != S both ways
PREFIX_CPU_CASES = [
    (F32, 1, 4, 2, 37, 37, 24, OFF, False, None, 0, 10),
    (F16, 1, 4, 2, 37, 50, 24, CAP, False, None, 0, 12),
    (F32, 1, 4, 1, 50, 37, 24, ALIBI, True, None, 0, 4),
    (F16, 1, 4, 2, 50, 50, 24, ALL, True, [[17, 33]], 0, 5),
    (F32, 2, 4, 2, 50, 50, 24, OFF, True, [[1, 20, 29], [50]], 9, 7),
    (F32, 1, 4, 2, 50, 50, 16, ALL, False, [[1, 20, 29]], 6, 25),
]


def _prefix_case_id(case):
    dtype, B, H, H_kv, T, S, D, mods, sinks, lengths, window, prefix = case
    return f"P{prefix}-" + _case_id((dtype, B, H, H_kv, T, S, D, True, mods, sinks, "bthd", lengths, window))


@pytest.mark.parametrize("case", PREFIX_CPU_CASES, ids=_prefix_case_id)
def test_a_prefix_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, mods, sinks, lengths, window, prefix = case
    doc_ids = None if lengths is None else doc_ids_of(lengths)
    _check(_prefix_case_id(case), dtype, B, H, H_kv, T, S, D, True, mods, sinks, "bthd", doc_ids, window,
           prefix=prefix)


def test_a_prefix_is_deterministic_and_compiles_to_the_same_bits():
    # the backward twice, bit for bit; torch.compile's custom op carries the prefix
    doc_ids = doc_ids_of([[20, 30]])
    q, k, v, do = make_inputs("prefix-bits", 1, 4, 2, 50, 50, 16, F32, "bthd")

    def grads(attend):
        o = attend(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    eager = functools.partial(flash_attention, doc_ids=doc_ids, prefix=6, mods=CAP)
    first = grads(eager)
    assert all(torch.equal(a, b) for a, b in zip(first, grads(eager), strict=True))
    assert not torch.equal(first[0], grads(functools.partial(flash_attention, doc_ids=doc_ids, mods=CAP))[0])
    torch._dynamo.reset()
    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, grads(compiled), strict=True))


def test_a_row_that_sees_no_key_returns_zero_and_its_sink():
    # T > S, causal: the first T - S rows see no key. With a sink O = 0, LSE = the sink (through
    # log2 units: to an ulp or two) and dQ = 0 exactly; no NaN anywhere
    T, S, H = 50, 30, 4
    q, k, v, do = (t.detach() for t in make_inputs("no-key", 1, H, 2, T, S, 16, F32, "bthd"))
    sinks = _sinks("no-key", H, S)
    o, lse = flash_attn_forward(q, k, v, mods=ALL, sinks=sinks)
    dq, dk, dv, dsinks = flash_attn_backward(do, q, k, v, o, lse, mods=ALL, sinks=sinks)
    assert all(torch.isfinite(t).all() for t in (o, lse, dq, dk, dv, dsinks))
    empty = slice(0, T - S)
    assert (o[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()
    torch.testing.assert_close(lse[:, :, empty], sinks.detach()[None, :, None].expand(1, H, T - S), rtol=1e-6, atol=0)


def test_off_is_the_same_bits_as_no_argument():
    q, k, v, do = make_inputs("off", 1, 4, 2, 37, 50, 24, F32, "bthd")
    runs = []
    for extra in ({}, {"mods": None, "sinks": None}, {"mods": ScoreMods(softcap=0.0, alibi=False)}):
        o = flash_attention(q, k, v, **extra)
        runs.append((o, *torch.autograd.grad(o, (q, k, v), do)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def test_autograd_is_the_two_halves_bit_for_bit_and_deterministic():
    # GQA, causal with documents, every modification; sinks in bf16 get their gradient in bf16
    doc_ids = doc_ids_of([[20, 30]])
    q, k, v, do = make_inputs("autograd", 1, 4, 2, 50, 50, 24, F32, "bthd")
    sinks = _sinks("autograd", 4, 50).detach().to(BF16).requires_grad_()

    def grads():
        o = flash_attention(q, k, v, doc_ids=doc_ids, mods=ALL, sinks=sinks)
        return (o, *torch.autograd.grad(o, (q, k, v, sinks), do))

    first, second = grads(), grads()
    assert first[4].dtype == BF16
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    o, lse = flash_attn_forward(q.detach(), k.detach(), v.detach(), doc_ids=doc_ids, mods=ALL, sinks=sinks)
    halves = (o, *flash_attn_backward(do, q.detach(), k.detach(), v.detach(), o, lse, doc_ids=doc_ids, mods=ALL,
                                      sinks=sinks))
    assert all(torch.equal(a, b) for a, b in zip(first, halves, strict=True))


def test_torch_compile_fullgraph_with_mods_and_sinks():
    # the custom ops carry the modifications and the sinks' gradient: the same bits as eager
    B, T, H, D = 1, 40, 2, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3, H, D, generator=gen, requires_grad=True)
    sinks = torch.randn(H, generator=gen).add(2.0).requires_grad_()

    def attend(qkv, sinks):
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        return flash_attention(q, k, v, mods=ALL, sinks=sinks).square().sum()

    eager = attend(qkv, sinks)
    grads_eager = torch.autograd.grad(eager, (qkv, sinks))
    torch._dynamo.reset()
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(qkv, sinks)
    grads = torch.autograd.grad(out, (qkv, sinks))
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(grads, grads_eager, strict=True))


# --------------------------------------------------------------------------------------------
# arguments, backends, launches


def _bad_sinks():
    return [(torch.zeros(3), r"sinks=a \(3,\) torch.float32 tensor on cpu"),
            (torch.zeros(4, dtype=torch.long), r"sinks=a \(4,\) torch.int64 tensor"),
            (torch.zeros(4, device="meta"), "on meta"),
            ([0.0] * 4, r"sinks=\[0.0, 0.0, 0.0, 0.0\]")]


@pytest.mark.parametrize("call", ["flash_attention", "flash_attn_forward", "flash_attn_backward"])
def test_bad_arguments_raise_one_line(call):
    q = torch.randn(1, 4, 8, 16)
    fn = getattr(kernels, call)
    args = (q, q, q, q, q, torch.zeros(1, 4, 8)) if call == "flash_attn_backward" else (q, q, q)
    cases = [({"mods": m}, re.escape(f"mods={m!r}: must be a kernels.score_mods.ScoreMods"))
             for m in ({"softcap": 2.0}, 2.0)]
    cases += [({"sinks": s}, rf"{message}.*: must be a \(4,\) floating-point tensor on cpu")
              for s, message in _bad_sinks()]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            fn(*args, **kwargs)
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("extra", [{"mods": CAP}, {"mods": ALIBI, "sinks": torch.zeros(2)}, {"prefix": 3}],
                         ids=["softcap", "alibi-sinks", "prefix"])
def test_gluon_refuses_modifications_in_one_line(extra):
    # raised before anything asks for a GPU: the same line on any machine
    q = torch.randn(1, 2, 8, 16)
    for call in (lambda: kernels.flash_attention(q, q, q, backend="gluon", **extra),
                 lambda: kernels.flash_attn_forward(q, q, q, backend="gluon", **extra)):
        with pytest.raises(ValueError, match='backend=gluon: the Hopper kernels take no softcap, ALiBi or prefix: '
                                             'backend="auto" or "triton" runs them') as raised:
            call()
        assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="take no softcap, ALiBi or prefix"):
        backends.backends(64, BF16, torch.device("cpu"), 4096, "gluon", modified=True)
    assert backends.backends(64, BF16, torch.device("cpu"), 4096, "auto", modified=True) == {
        "forward": "triton", "backward": "triton"}


def test_each_modification_has_its_own_launch():
    # a launch is kept per signature: one bound without a modification is never reused with it
    q = torch.randn(1, 4, 8, 16)
    signatures = {api._signature((q, q, q), True, 0.25, None, "auto", mods, sinks, prefix)
                  for mods in (OFF, CAP, ScoreMods(softcap=3.0), ALIBI, ALL)
                  for sinks in (None, torch.zeros(4)) for prefix in (0, 5)}
    assert len(signatures) == 20


@pytest.mark.gpu
def test_gpu_a_launch_is_bound_wherever_its_absent_operands_sit(monkeypatch):
    # ALiBi's slopes and the sinks sit after the bounds among the kernels' operands: absent bounds
    # (None) before a present operand still bind (nothing binds in the interpreter), so a second
    # call of the same signature launches the bound kernels, never through the Launcher again
    def through_the_launcher(*args, **kwargs):
        raise AssertionError("launched through the Launcher, not the bound kernel")
    for mods, with_sinks in [(ALIBI, False), (OFF, True), (ALL, True)]:
        gen = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 2, 200, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
        sinks = torch.randn(2, generator=gen).cuda().requires_grad_() if with_sinks else None
        first = kernels.flash_attention(q, k, v, mods=mods, sinks=sinks, backend="triton")
        first.sum().backward()
        with monkeypatch.context() as m:
            m.setattr(fwd.Launcher, "bind", through_the_launcher)
            m.setattr(fwd.Launcher, "__call__", through_the_launcher)
            again = kernels.flash_attention(q, k, v, mods=mods, sinks=sinks, backend="triton")
            again.sum().backward()
        assert torch.equal(first, again)


# --------------------------------------------------------------------------------------------
# GPU: long and odd shapes in bf16 and fp16 against float64

LENGTHS = [[1, 700, 1300, 47]]  # 2048 tokens: a one-token document, others across tiles
CAPPED_ALIBI = ScoreMods(softcap=4.0, alibi=True)  # caps that bite: these scores are about N(0, 1)

# (dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, document lengths or None, window)
GPU_CASES = [
    (BF16, 2, 4, 2, 1000, 1000, 64, True, ScoreMods(softcap=3.0), False, "packed", None, 0),
    (F16, 1, 4, 2, 2048, 2048, 128, True, ScoreMods(softcap=5.0), False, "bthd", None, 0),
    (BF16, 1, 8, 2, 1000, 1537, 64, True, ALIBI, False, "bthd", None, 0),
    (F16, 1, 4, 4, 1000, 1000, 128, False, ALIBI, False, "contiguous", None, 0),
    (BF16, 2, 4, 2, 2048, 2048, 128, True, OFF, True, "packed", None, 0),
    (F16, 1, 4, 1, 1537, 1000, 64, True, OFF, True, "bthd", None, 0),
    (BF16, 1, 8, 2, 2048, 2048, 64, True, CAPPED_ALIBI, True, "bthd", None, 0),
    (F16, 1, 4, 2, 1000, 1000, 128, False, CAPPED_ALIBI, True, "contiguous", None, 0),
    (BF16, 1, 4, 2, 2048, 2048, 128, True, CAPPED_ALIBI, True, "packed", LENGTHS, 0),
    (F16, 1, 4, 2, 2048, 2048, 64, True, CAPPED_ALIBI, True, "bthd", None, 300),
    (BF16, 1, 4, 2, 2048, 2048, 64, True, ScoreMods(alibi=True), True, "bthd", LENGTHS, 500),
    (F32, 1, 4, 2, 1000, 1000, 64, True, ScoreMods(softcap=5.0, alibi=True), True, "bthd", None, 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, lengths, window = case
    doc_ids = None if lengths is None else doc_ids_of(lengths, "cuda")
    _check("gpu-" + _case_id(case), dtype, B, H, H_kv, T, S, D, causal, mods, sinks, layout, doc_ids, window, "cuda")


PREFIX_GPU_CASES = [
    (BF16, 2, 4, 2, 2048, 2048, 64, OFF, False, None, 0, 300),
    (F16, 1, 4, 2, 1537, 2048, 128, CAPPED_ALIBI, True, None, 0, 700),
    (BF16, 1, 8, 2, 2048, 2048, 128, ScoreMods(softcap=3.0), True, LENGTHS, 500, 100),
    (BF16, 1, 4, 1, 2048, 2048, 64, OFF, True, LENGTHS, 0, 1000),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFIX_GPU_CASES, ids=_prefix_case_id)
def test_gpu_a_prefix_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, mods, sinks, lengths, window, prefix = case
    doc_ids = None if lengths is None else doc_ids_of(lengths, "cuda")
    first = _check("gpu-" + _prefix_case_id(case), dtype, B, H, H_kv, T, S, D, True, mods, sinks, "bthd", doc_ids,
                   window, "cuda", prefix=prefix)
    again = _check("gpu-" + _prefix_case_id(case), dtype, B, H, H_kv, T, S, D, True, mods, sinks, "bthd", doc_ids,
                   window, "cuda", prefix=prefix)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))  # deterministic, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, LENGTHS], ids=["no-bounds", "documents"])
def test_gpu_backward_is_deterministic_and_launches_are_kept_apart(lengths):
    # GQA, every modification, twice (without bounds each call launches anew; with documents the
    # second call is a bound launch); then the plain call, bound before and after, is unchanged
    doc_ids = None if lengths is None else doc_ids_of(lengths * 2, "cuda")
    q, k, v, do = make_inputs(f"gpu-determinism-{lengths}", 2, 8, 2, 2048, 2048, 128, BF16, "packed", "cuda")
    sinks = _sinks("gpu-determinism", 8, 2048, "cuda")

    def grads(**extra):
        o = flash_attention(q, k, v, doc_ids=doc_ids, **extra)
        leaves = (q, k, v, sinks) if "sinks" in extra else (q, k, v)
        return (o, *torch.autograd.grad(o, leaves, do))

    plain = grads()
    first, second = grads(mods=ALL, sinks=sinks), grads(mods=ALL, sinks=sinks)
    assert all(torch.isfinite(t).all() and torch.equal(a, t) for a, t in zip(first, second, strict=True))
    assert not torch.equal(first[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(grads(), plain, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("D, lengths", [(64, LENGTHS), (128, None)], ids=["D64-documents", "D128"])
def test_gpu_the_hopper_kernels_take_sinks(D, lengths):
    # a sink starts each row's softmax in the Gluon forward; their backward reads it in the LSE
    if why := backends.unsupported(D, BF16, torch.device("cuda"), "gluon"):
        pytest.skip(why)
    doc_ids = None if lengths is None else doc_ids_of(lengths, "cuda")
    case = f"gpu-hopper-sinks-D{D}"
    first = _check(case, BF16, 1, 8, 2, 2048, 2048, D, True, OFF, True, "bthd", doc_ids, 0, "cuda", "gluon")
    again = _check(case, BF16, 1, 8, 2, 2048, 2048, D, True, OFF, True, "bthd", doc_ids, 0, "cuda", "gluon")
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))  # deterministic, bit for bit


@pytest.mark.gpu
def test_gpu_auto_runs_the_portable_kernels_with_modifications():
    # at lengths where "auto" picks the Hopper kernels on sm_90, modifications and a prefix go to the
    # portable ones
    q, k, v, do = make_inputs("gpu-auto", 1, 4, 2, 4096, 4096, 64, BF16, "bthd", "cuda")
    sinks = _sinks("gpu-auto", 4, 4096, "cuda")
    for extra in ({"mods": ALL}, {"prefix": 1000}):
        outs = []
        for backend in ("auto", "triton"):
            o = kernels.flash_attention(q, k, v, backend=backend, sinks=sinks, **extra)
            outs.append((o, *torch.autograd.grad(o, (q, k, v, sinks), do)))
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
