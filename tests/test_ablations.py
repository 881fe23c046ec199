"""The ablations' modifications outside our kernels: the prefix-LM's mask, the modifications in
naive, SDPA, FlexAttention and FlashAttention-4 (model/attention.py, model/peers.py), the model's
per-layer windows, their warm-up, its sinks and a prefix-LM's loss, and the config's refusals.

Each attention's output and gradients (the sinks' too) are checked against float64 attention on
fresh random inputs at an odd length, with documents, a window and GQA; the bound is the float64
result's distance to PyTorch's own attention in the same dtype (tests/helpers.py). Our kernels'
modifications are tests/test_score_mods_kernels.py's. The test_gpu_* tests need CUDA; FA4's skip
where it cannot run.

    .venv/bin/python -m pytest tests/test_ablations.py -q
"""

import pytest
import torch

from configs.validate import ConfigError, validate
from data.tokenizer import EOT, document_ids
from kernels.cross_entropy import IGNORE_INDEX
from kernels.masking import Mask, once_per_batch
from kernels.reference.flash_ref import attention_reference
from kernels.score_mods import ScoreMods
from model import ATTENTIONS, GPT
from model.attention import Modifications, naive_attention, sdpa_attention
from model.config import ModelConfig
from model.gpt import layer_windows, warmed_window
from model.peers import fa4_unsupported, flex_attention
from tests.helpers import TINY, assert_within_own_error, compose

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def inputs(B, H, H_kv, T, D, dtype, device, seed, sinks=True, grad=True):
    """q (B, H, T, D), k, v (B, H_kv, T, D), dO, and sinks (H,) (or None), each requiring grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(B, H, T, D), (B, H_kv, T, D), (B, H_kv, T, D)]
    q, k, v = (torch.randn(s, generator=gen, device=device).to(dtype).requires_grad_(grad) for s in shapes)
    dout = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    sink = (2 * torch.randn(H, generator=gen, device=device)).requires_grad_(grad) if sinks else None
    return q, k, v, dout, sink


def documents(B, T, device, seed, every=9):
    gen = torch.Generator().manual_seed(seed)
    return document_ids(torch.where(torch.randint(every, (B, T), generator=gen) == 0, EOT, 1)).to(device)


def with_grads(fn, q, k, v, dout, sinks, **options):
    """(out, dq, dk, dv[, dsinks]) of fn(q, k, v, sinks=sinks, **options)."""
    out = fn(q, k, v, sinks=sinks, **options)
    wrt = (q, k, v) if sinks is None else (q, k, v, sinks)
    return (out, *torch.autograd.grad(out, wrt, dout))


def check(fn, dtype, q, k, v, dout, sinks, n_terms, **options):
    """fn's output and gradients within the distance of naive attention in dtype to float64."""
    got = with_grads(fn, q, k, v, dout, sinks, **options)
    own = with_grads(naive_attention, q, k, v, dout, sinks, **options)
    as64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    ref64 = with_grads(naive_attention, *as64, dout.double(), sinks64, **options)
    for name, g, o, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, own, ref64):
        assert_within_own_error(name, g, r, o, n_terms if name != "dsinks" else n_terms * q.size(0), dtype)


# ---------------------------------------------------------------------------
# the prefix-LM's mask, and the dense reference


def test_a_prefix_is_seen_whole_by_its_document_and_bounded_by_the_window():
    T, P, W = 23, 4, 6
    doc_ids = torch.tensor([[0] * 9 + [1] * 2 + [2] * 12])
    starts = [0] * 9 + [9] * 2 + [11] * 12
    for window in (0, W):
        dense = Mask(T, T, True, doc_ids, window, prefix=P).dense()[0, 0]
        for i in range(T):
            for j in range(T):
                in_doc = starts[i] == starts[j]
                shown = j <= i or j - starts[j] < P
                near = window == 0 or i - j < window
                assert bool(dense[i, j]) == (in_doc and shown and near), (window, i, j)
    # without documents, the sequence's first P keys; bottom-right for fewer queries than keys
    dense = Mask(3, 8, True, prefix=6).dense()[0, 0]
    assert dense.tolist() == [[j <= max(i + 5, 5) for j in range(8)] for i in range(3)]


@pytest.mark.parametrize("mods", [ScoreMods(softcap=2.0), ScoreMods(alibi=True), ScoreMods(3.0, True)],
                         ids=["softcap", "alibi", "both"])
def test_naive_attention_is_the_reference_formula(mods):
    q, k, v, _, sinks = inputs(2, 4, 2, 29, 8, F64, "cpu", seed=1)
    doc_ids = documents(2, 29, "cpu", seed=1)
    got = naive_attention(q, k, v, doc_ids, 7, mods=mods, sinks=sinks)
    ref = attention_reference(q, k, v, True, None, F64, doc_ids, 7, mods=mods, sinks=sinks)[0]
    assert (got - ref).abs().max() < 1e-12


# ---------------------------------------------------------------------------
# naive and SDPA on the CPU: forward and backward, the sinks' gradient too

CPU_CASES = {  # (attention, options), B = 2, H = 4, H_kv = 2, T = 37, fp32
    "naive-softcap-alibi-sinks-prefix-docs-window": (naive_attention, dict(mods=ScoreMods(5.0, True), prefix=5,
                                                                           window=11, docs=True)),
    "naive-softcap": (naive_attention, dict(mods=ScoreMods(softcap=1.5))),
    "sdpa-alibi-sinks-prefix-docs-window": (sdpa_attention, dict(mods=ScoreMods(alibi=True), prefix=5, window=11,
                                                                 docs=True)),
    "sdpa-sinks": (sdpa_attention, dict()),
    "sdpa-prefix-docs": (sdpa_attention, dict(prefix=3, docs=True, sinks=False)),
}


@pytest.mark.parametrize("case", CPU_CASES)
def test_naive_and_sdpa_match_float64_with_the_modifications(case):
    fn, options = CPU_CASES[case]
    options = dict(options)
    q, k, v, dout, sinks = inputs(2, 4, 2, 37, 16, F32, "cpu", seed=len(case), sinks=options.pop("sinks", True))
    if options.pop("docs", False):
        options["doc_ids"] = documents(2, 37, "cpu", seed=2)
    check(fn, F32, q, k, v, dout, sinks, n_terms=37, **options)


def test_sdpa_refuses_a_softcap_in_one_line():
    q, k, v, _, _ = inputs(1, 2, 2, 8, 8, F32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"^sdpa_attention: softcap=30.0: SDPA takes a mask or a bias"):
        sdpa_attention(q, k, v, mods=ScoreMods(softcap=30.0))


def test_flex_forward_with_the_modifications_matches_float64_on_the_cpu():
    # FlexAttention has no backward on the CPU, nor an LSE there: the sinks are checked on the GPU
    B, H, H_kv, T, D = 2, 4, 2, 131, 16
    q, k, v, _, _ = inputs(B, H, H_kv, T, D, F32, "cpu", seed=5, sinks=False, grad=False)
    options = dict(doc_ids=documents(B, T, "cpu", seed=5, every=30), window=40, prefix=6, mods=ScoreMods(4.0, True))
    with torch.no_grad():
        got = flex_attention(q, k, v, **options)
        ref64 = naive_attention(q.double(), k.double(), v.double(), **options)
        own = naive_attention(q, k, v, **options)
    assert_within_own_error("flex out", got, ref64, own, n_terms=T)


# ---------------------------------------------------------------------------
# the model: per-layer windows, their warm-up, sinks, a prefix-LM's loss


def test_a_window_pattern_repeats_over_the_layers_and_warms_up_in_eighths():
    assert layer_windows([8, 8, 0], 0, 5) == [8, 8, 0, 8, 8]
    assert layer_windows([], 6, 3) == [6, 6, 6]
    assert [warmed_window(64, step, 16) for step in range(0, 18, 2)] == [8, 16, 24, 32, 40, 48, 56, 64, 64]
    assert warmed_window(0, 0, 16) == 0 and warmed_window(3, 0, 100) == 1
    model = GPT(ModelConfig(name="t", n_layer=4, n_head=2, d_model=32, max_seq_len=64, window_pattern=[16, 0]), "sdpa")
    assert [b.attn.window for b in model.blocks] == [16, 0, 16, 0]
    model.warm_windows(0, 8)
    assert [b.attn.window for b in model.blocks] == [2, 0, 2, 0]
    local = GPT(ModelConfig(name="t", n_layer=4, n_head=2, d_model=32, max_seq_len=64), "sdpa", window=16)
    plain = GPT(ModelConfig(name="t", n_layer=4, n_head=2, d_model=32, max_seq_len=64), "sdpa")
    assert local.flops_per_token(64) < model.flops_per_token(64) < plain.flops_per_token(64)


def test_sinks_are_parameters_that_train_and_are_checkpointed():
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, d_model=32, max_seq_len=32)
    model = GPT(cfg, "naive", mods=Modifications(sinks=True))
    assert [name for name in model.state_dict() if "sinks" in name] == ["blocks.0.attn.sinks", "blocks.1.attn.sinks"]
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    assert all(b.attn.sinks.grad.abs().min() > 0 for b in model.blocks)
    assert not any("sinks" in name for name in GPT(cfg, "naive").state_dict())


def test_a_prefix_lm_counts_only_the_targets_its_prefix_does_not_show():
    model = GPT(ModelConfig(name="t", n_layer=1, n_head=2, d_model=32, max_seq_len=16), "naive",
                mods=Modifications(prefix=4))
    targets = torch.arange(16).expand(2, 16)
    doc_ids = torch.tensor([[0] * 16, [0] * 6 + [1] * 10])
    kept = model._past_the_prefix(targets, doc_ids) != IGNORE_INDEX
    # the first 3 positions of each document predict a token of its prefix, which they see
    assert kept[0].tolist() == [False] * 3 + [True] * 13
    assert kept[1].tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 7


def test_every_attention_gives_the_model_the_same_logits_and_loss():
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=40, window_pattern=[9, 0],
                      loss="full")
    mods = Modifications(ScoreMods(alibi=True), sinks=True, prefix=5)
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))
    idx[:, ::13] = EOT
    results = {}
    for attn in ("naive", "sdpa"):
        torch.manual_seed(0)
        model = GPT(cfg, attn, mods=mods).double()
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.sinks)
        logits, loss = model(idx, idx, doc_ids=document_ids(idx))
        results[attn] = logits, loss
    assert (results["naive"][0] - results["sdpa"][0]).abs().max() < 1e-10
    assert abs(results["naive"][1].item() - results["sdpa"][1].item()) < 1e-12


# ---------------------------------------------------------------------------
# the config: what cannot run is refused in one line


@pytest.mark.parametrize("overrides, message", [
    (["attn=sdpa", "attn.softcap=30"], "attn.softcap=30.0: attn=sdpa cannot compute it (SDPA takes a mask or a "
                                       "bias, not a function of each score): use attn=naive, triton, flex or fa4"),
    (["attn=triton", "attn.backend=gluon", "attn.prefix=4"], "attn.prefix=4: the Hopper kernels"),
    (["attn=fa4", "attn.alibi=true"], "attn.alibi=True: attn=fa4 cannot compute it (FlashAttention-4 has no ALiBi "
                                      "argument)"),
    (["attn=triton", "attn.backend=gluon", "attn.alibi=true"], "attn.alibi=True: the Hopper kernels"),
    (["attn.softcap=-1"], "attn.softcap=-1.0: must be a finite number > 0, or 0 for none"),
    (["attn.prefix=32"], "attn.prefix=32: must be below seq_len 32"),
    (["model.window_pattern=[8,0]", "attn.window=4"], "model.window_pattern=[8, 0]: sets every layer's window"),
    (["model.window_pattern=[8,0]"], "model.window_pattern=[8, 0]: needs 1 to model.n_layer = 1 windows"),
    (["model.window_pattern=[32]"], "model.window_pattern=[32]: windows must be 0 (global) or in [1, seq_len"),
    (["attn.window_warmup=10"], "attn.window_warmup=10: warms up sliding windows"),
    (["parallel.cp=2", "attn=triton", "attn.alibi=true"], "attn.alibi=True: is not supported with parallel.cp > 1"),
])
def test_what_cannot_run_is_refused_in_one_line(overrides, message):
    cfg = compose([*TINY, *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=2 if "parallel.cp=2" in overrides else 1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_each_attention_computes_what_it_does_not_refuse():
    refused = {name: sorted(a.refuses) for name, a in ATTENTIONS.items()}
    assert refused == {"naive": [], "sdpa": ["softcap"], "triton": [], "flex": [], "fa4": ["alibi", "prefix"]}


# ---------------------------------------------------------------------------
# On a CUDA GPU: FlexAttention, FlashAttention-4 and SDPA, forward and backward

GPU_OPTIONS = {  # T = 1000, D = 64, H = 4, H_kv = 2, bf16
    "softcap-alibi-sinks-prefix-docs-window": dict(mods=ScoreMods(30.0, True), prefix=100, window=300, docs=True),
    "softcap-sinks": dict(mods=ScoreMods(softcap=5.0)),
    "alibi-sinks-docs": dict(mods=ScoreMods(alibi=True), docs=True),
    "softcap-sinks-window": dict(mods=ScoreMods(softcap=5.0), window=300),
    "alibi-sinks-prefix": dict(mods=ScoreMods(alibi=True), prefix=100),
}


def _gpu_check(fn, case, seed):
    options = dict(GPU_OPTIONS[case])
    q, k, v, dout, sinks = inputs(2, 4, 2, 1000, 64, BF16, "cuda", seed)
    if options.pop("docs", False):
        options["doc_ids"] = documents(2, 1000, "cuda", seed, every=150)
    check(fn, BF16, q, k, v, dout, sinks, n_terms=1, **options)  # one rounding to bf16 dominates


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_OPTIONS)
def test_gpu_flex_matches_float64_with_the_modifications(case):
    torch._dynamo.reset()
    _gpu_check(flex_attention, case, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["softcap-sinks", "softcap-sinks-window"])
def test_gpu_fa4_matches_float64_with_softcap_and_sinks(case):
    if why := fa4_unsupported(64, BF16, torch.device("cuda")):
        pytest.skip(why)
    _gpu_check(ATTENTIONS["fa4"].fn, case, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["alibi-sinks-docs", "alibi-sinks-prefix"])
def test_gpu_sdpa_matches_float64_with_alibi_sinks_and_a_prefix(case):
    _gpu_check(sdpa_attention, case, seed=3)


def test_a_batch_builds_its_masks_once_for_each_window_of_its_layers():
    # documents with model.window_pattern: the layers alternate windows, and each window's Bounds
    # (or BlockMask) is built once per batch, not again at every change of window
    calls = []

    @once_per_batch
    def build(doc_ids, window):
        calls.append(window)
        return window
    doc_ids = torch.zeros(1, 8, dtype=torch.long)
    for window in [8, 8, 8, 0] * 3:
        assert build(doc_ids, window) == window
    assert calls == [8, 0]
    build(torch.zeros(1, 8, dtype=torch.long), 8)  # the next batch
    assert calls == [8, 0, 8]
