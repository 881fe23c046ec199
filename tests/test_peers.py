"""FlexAttention and FlashAttention-4, the attentions ours is measured against (model/peers.py).

On the CPU: compiled FlexAttention's forward against float64 attention with windows, documents and
GQA at an odd T over two BlockMask tiles, alone and in the model (torch has no FlexAttention
backward on the CPU, nor a float64 kernel: training there is refused); attn=flex and attn=fa4
refused in one line before anything is created; the cu_seqlens FlashAttention-4 gets from doc_ids;
a batch's mask built once for all its layers; the presets and the equivalence check take flex.
The error bound is the float64 reference's distance to PyTorch's own attention in the same dtype
(tests/helpers.py, assert_within_own_error). The test_gpu_* tests (CUDA) check both forward and
backward, FA4's decoding against a cache, and training runs, eager and compiled, with documents, a
window and GQA; FA4's are skipped with the reason where it cannot run (no flash-attn-4, not sm_90/100).
The CPU tests compile FlexAttention twice: ~25 s of CPU time cold, a few once inductor's on-disk
cache holds the kernels.

    .venv/bin/python -m pytest tests/test_peers.py -q
"""

import ast
import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

import train as train_module
from configs.validate import ConfigError, validate
from data.tokenizer import EOT, document_ids
from kernels.masking import cu_seqlens, once_per_batch
from model import ATTENTIONS, GPT
from model.attention import naive_attention
from model.config import ModelConfig
from model.peers import fa4_unsupported, flex_attention
from tests.helpers import CONFIGS, REPO, TINY, assert_within_own_error, compose, metrics
from trainer import preflight

BF16, F32 = torch.bfloat16, torch.float32


def packed_inputs(B, H, H_kv, T, D, dtype, device, seed, grad=True):
    """q (B, H, T, D), k, v (B, H_kv, T, D) as the model makes them, transposed views of one
    (B, T, H + 2 H_kv, D) tensor (that requires grad, with grad), and dO (B, H, T, D)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(B, T, H + 2 * H_kv, D, generator=gen, device=device).to(dtype).requires_grad_(grad)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, H_kv, H_kv], dim=2))
    return q, k, v, torch.randn(B, T, H, D, generator=gen, device=device).to(dtype).transpose(1, 2)


def random_documents(B, T, device, seed, every=12) -> torch.Tensor:
    """(B, T) ids of packed documents, about one end-of-text in `every` tokens, as training makes them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.where(torch.randint(every, (B, T), generator=gen) == 0, EOT, 1)
    return document_ids(tokens).to(device)


def with_grads(fn, q, k, v, dout, **options):
    """(out, dq, dk, dv) of fn(q, k, v, **options)."""
    out = fn(q, k, v, **options)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# ---------------------------------------------------------------------------
# FlexAttention on the CPU: inference


@pytest.mark.parametrize("window, documents", [(0, False), (7, False), (0, True), (9, True)],
                         ids=["causal", "window", "documents", "window-documents"])
def test_flex_forward_matches_float64_on_the_cpu(window, documents):
    # GQA, T = 131: two 128-row tiles of the BlockMask, the second partial; the same shapes and
    # layout in every case, so that two compiled graphs serve all (the window is read, not compiled)
    B, H, H_kv, T, D = 2, 4, 2, 131, 16
    doc_ids = random_documents(B, T, "cpu", seed=window) if documents else None
    q, k, v, _ = packed_inputs(B, H, H_kv, T, D, F32, "cpu", seed=window + 10 * documents, grad=False)
    with torch.no_grad():
        got = flex_attention(q, k, v, doc_ids=doc_ids, window=window)
        ref64 = naive_attention(q.double(), k.double(), v.double(), doc_ids=doc_ids, window=window)
        own = naive_attention(q, k, v, doc_ids=doc_ids, window=window)
    assert_within_own_error("flex out", got, ref64, own, n_terms=T)


def test_flex_in_the_model_gives_sdpa_logits_on_the_cpu():
    # the model's q, k, v are what the test above takes: the same compiled graph runs here
    cfg = ModelConfig(name="test", n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=131)
    idx = torch.randint(0, 50257, (2, 131), generator=torch.Generator().manual_seed(3))
    idx[:, ::17] = EOT
    doc_ids = document_ids(idx)
    logits = {}
    for attn, dtype in (("flex", F32), ("sdpa", F32), ("sdpa", torch.float64)):
        torch.manual_seed(0)
        with torch.no_grad():
            logits[attn, dtype] = GPT(cfg, attn, window=9).to(dtype)(idx, doc_ids=doc_ids)[0]
    assert_within_own_error("logits", logits["flex", F32], logits["sdpa", torch.float64], logits["sdpa", F32],
                            n_terms=max(4 * cfg.d_model, idx.size(1)))


# ---------------------------------------------------------------------------
# What cannot run here is refused in one line


@pytest.mark.parametrize("attn, why", [
    ("flex", "has no FlexAttention backward on the CPU (inference only): train attn=flex on a CUDA GPU"),
    ("fa4", "FlashAttention-4 needs the flash-attn-4 package (pip install flash-attn-4, CUDA 13) and an sm_90 or "
            "sm_100 GPU; device is cpu")])
def test_training_on_the_cpu_is_refused_in_one_line_and_creates_nothing(attn, why, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the run dir (outputs/...) would be made
    with pytest.raises(SystemExit) as exit_:
        preflight.preflight([*TINY, f"attn={attn}"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: attn={attn}: cannot run here: ") and why in lines[0], lines
    assert lines[0].endswith("; use attn=sdpa")
    assert list(tmp_path.iterdir()) == []


def test_nothing_imports_flash_attention_4_until_it_runs():
    # an optional package: imported inside the functions that call it, never when a module is imported
    for path in [*REPO.glob("*.py"), *REPO.glob("[!.]*/**/*.py")]:
        tree = ast.parse(path.read_text())
        in_functions = {id(node) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for node in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in in_functions or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(name.startswith("flash_attn") for name in names), f"{path}:{node.lineno}"


# ---------------------------------------------------------------------------
# FlashAttention-4's documents: cu_seqlens


def test_cu_seqlens_cut_the_flattened_rows_at_documents_and_rows():
    tokens = torch.tensor([[1, EOT, 2, 3, EOT, 4], [EOT, 5, 6, 7, 8, EOT], [1, 2, 3, 4, 5, 6]])
    offsets = cu_seqlens(document_ids(tokens))  # ids [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1], [0] * 6]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 2, 5, 6, 7, 12, 18]


@pytest.mark.parametrize("seed", range(5))
def test_cu_seqlens_match_a_walk_over_the_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = (int(n) for n in torch.randint(1, 40, (2,), generator=gen))
    doc_ids = random_documents(B, T, "cpu", seed, every=int(torch.randint(1, 8, (1,), generator=gen)))
    starts = [b * T + t for b in range(B) for t in range(T) if t == 0 or doc_ids[b, t] != doc_ids[b, t - 1]]
    assert cu_seqlens(doc_ids).tolist() == starts + [B * T]


def test_a_batch_mask_is_built_once_for_all_its_layers():
    built = []
    mask = once_per_batch(lambda doc_ids, window: built.append(window) or len(built))
    doc_ids = torch.zeros(2, 5, dtype=torch.int32)
    assert [mask(doc_ids, 3) for _ in range(4)] == [1] * 4  # every layer of a step: one build
    assert mask(doc_ids, 4) == 2  # another window
    doc_ids[0, 3] = 1
    assert mask(doc_ids, 4) == 3  # the ids changed in place
    assert mask(doc_ids.clone(), 4) == 4  # the next batch, even with the same ids


# ---------------------------------------------------------------------------
# The presets and the equivalence check


@pytest.mark.parametrize("preset", ["ablation", "sweep", "gpt2_16k", "equivalence_gpu"])
def test_the_gpu_presets_take_attn_flex(preset):
    cfg = compose([f"experiment={preset}", "attn=flex"])
    assert cfg.attn.name == "flex"
    with torch.device("meta"):
        GPT(cfg.model, cfg.attn.name, window=cfg.attn.window)
    if torch.cuda.is_available():
        validate(cfg)
    else:  # device=auto: the CPU here
        with pytest.raises(ConfigError, match="attn=flex: cannot run here: .*no FlexAttention backward on the CPU"):
            validate(cfg)


def test_the_sweep_compares_flex_beside_ours():
    sweep = OmegaConf.load(CONFIGS / "experiment" / "sweep.yaml").hydra.sweeper.params
    assert sweep.attn.split(",") == ["naive", "sdpa", "triton", "flex"]


def load_equivalence():
    spec = importlib.util.spec_from_file_location("loss_equivalence", REPO / "scripts" / "loss_equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_equivalence_check_compares_every_attention_that_can_train_here(tmp_path):
    equivalence = load_equivalence()
    base = TINY + [f"data.root={tmp_path}", "wandb.mode=disabled"]
    cfg = compose(base, config_name="equivalence", schema=equivalence.EquivalenceConfig)
    attns, left_out = equivalence.attentions(cfg)  # TINY trains on the CPU, where neither peer trains
    assert attns == ["sdpa", "naive", "triton"] and sorted(left_out) == ["fa4", "flex"], (attns, left_out)
    assert all(why.startswith(f"attn={name}: cannot run here: ") for name, why in left_out.items())
    equivalence.check_config(cfg)
    explicit = compose(base + ["attns=[sdpa,flex]"], config_name="equivalence", schema=equivalence.EquivalenceConfig)
    with pytest.raises(ConfigError, match=r"attns=\['sdpa', 'flex'\]: attn=flex: cannot run here: "):
        equivalence.check_config(explicit)


# ---------------------------------------------------------------------------
# On a CUDA GPU: forward and backward, decoding, training


@pytest.fixture(autouse=True)
def _fresh_graphs_on_the_gpu(request):
    """Dynamo compiles a function at most 8 times, then runs it eagerly: each GPU test, with shapes of
    its own, starts from none, so that every one of them runs compiled flex."""
    if request.node.get_closest_marker("gpu"):
        torch._dynamo.reset()


def fa4_or_skip(head_dim: int = 64) -> None:
    why = fa4_unsupported(head_dim, BF16, torch.device("cuda"))
    if why:
        pytest.skip(why)


GPU_CASES = [  # (dtype, H, H_kv, window, documents); T = 1000 over 8 tiles, D = 64
    (BF16, 4, 4, 0, False), (BF16, 4, 2, 0, True), (BF16, 4, 2, 256, False), (BF16, 4, 2, 100, True),
    (F32, 4, 1, 100, True)]
GPU_IDS = [f"{str(dtype)[6:]}-H{H}kv{H_kv}-W{window}{'-docs' * documents}"
           for dtype, H, H_kv, window, documents in GPU_CASES]


def _check_forward_and_backward(fn, dtype, H, H_kv, window, documents, seed, **options):
    B, T, D = 2, 1000, 64
    doc_ids = random_documents(B, T, "cuda", seed, every=150) if documents else None
    q, k, v, dout = packed_inputs(B, H, H_kv, T, D, dtype, "cuda", seed)
    got = with_grads(fn, q, k, v, dout, doc_ids=doc_ids, window=window, **options)
    own = with_grads(naive_attention, q, k, v, dout, doc_ids=doc_ids, window=window)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref64 = with_grads(naive_attention, q64, k64, v64, dout.double(), doc_ids=doc_ids, window=window)
    # fp32: the kernels' sums over T keys; bf16: one rounding of the result to bf16 dominates them
    n_terms = T if dtype == F32 else 1
    for name, g, o, r in zip(("out", "dq", "dk", "dv"), got, own, ref64, strict=True):
        assert g.dtype == dtype
        assert_within_own_error(name, g, r, o, n_terms, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(len(GPU_CASES)), ids=GPU_IDS)
def test_gpu_flex_matches_float64(seed):
    _check_forward_and_backward(flex_attention, *GPU_CASES[seed], seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("seed, deterministic", [(i, False) for i in range(4)] + [(3, True)],
                         ids=[*GPU_IDS[:4], f"{GPU_IDS[3]}-deterministic"])
def test_gpu_fa4_matches_float64(seed, deterministic):
    fa4_or_skip()  # bf16 and fp16 only: the first four cases
    _check_forward_and_backward(ATTENTIONS["fa4"].fn, *GPU_CASES[seed], seed=seed, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 300])
def test_gpu_fa4_decodes_the_newest_queries_against_a_cache(window):
    # FA4's causal mask is bottom-right aligned, as kernels/masking.py's Mask: 3 new queries are the cache's last 3 of 900 filled
    fa4_or_skip()
    B, H, H_kv, D, max_len, filled = 2, 4, 2, 64, 1024, 900
    gen = torch.Generator(device="cuda").manual_seed(window)
    q = torch.randn(B, H, 3, D, generator=gen, device="cuda").to(BF16)
    k_cache, v_cache = (torch.randn(B, H_kv, max_len, D, generator=gen, device="cuda").to(BF16) for _ in range(2))
    length = torch.tensor([filled], dtype=torch.int32, device="cuda")
    got = ATTENTIONS["fa4"].decode(q, k_cache, v_cache, length, filled, window)
    keys = (k_cache[:, :, :filled], v_cache[:, :, :filled])
    ref64 = naive_attention(q.double(), *(t.double() for t in keys), window=window)
    assert_within_own_error("decode", got, ref64, naive_attention(q, *keys, window=window), 1, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("attn, overrides, why", [
    ("fa4", ["dtype=float32"], "FlashAttention-4 runs bf16 or fp16, not float32: set dtype=auto or bfloat16"),
    ("flex", ["model.d_model=16"], "FlexAttention's Triton kernels need head dim 16 or more, not 8")])
def test_gpu_what_a_peer_cannot_run_is_refused_in_one_line(attn, overrides, why):
    if attn == "fa4":
        fa4_or_skip()
    cfg = compose([o for o in TINY if o != "device=cpu"] + ["device=cuda", f"attn={attn}", *overrides])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert str(refused.value) == f"attn={attn}: cannot run here: {why}; use attn=sdpa"


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("attn", ["flex", "fa4"])
def test_gpu_each_peer_trains_with_documents_a_window_and_gqa(attn, compile, short_docs, tmp_path):
    # bf16 autocast, head dim 64, one kv head; compiled, the model's graph breaks where a peer
    # needs Python (the BlockMask, FA4's launch); sampling at the end decodes through the registry
    if attn == "fa4":
        fa4_or_skip()
    overrides = [o for o in TINY if o != "device=cpu"] + short_docs + [
        "device=cuda", f"attn={attn}", f"compile={str(compile).lower()}", "model.d_model=128", "model.n_kv_head=1",
        "data.doc_mask=true", "attn.window=16", "max_steps=12", "log_interval=1", "eval_interval=0",
        "sample_tokens=4", "wandb.mode=disabled"]
    summary = train_module.train(compose(overrides), tmp_path)
    losses = [r["loss"] for r in metrics(tmp_path) if "loss" in r]
    assert summary["status"] == "ok" and len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
