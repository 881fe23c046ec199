"""The GPT model: shapes, initial loss, that every attention computes the same function, and that
activation checkpointing (offload too), the tiled MLP and the chunked loss change nothing but memory and time.

naive and sdpa are compared in float64 (where both are exact up to rounding), triton through
Triton's CPU interpreter in float32. A float32 result is bounded by the float64 reference's
distance to PyTorch's own float32 computation of the same thing (tests/helpers.py,
assert_within_own_error), so the bounds hold whatever the CPU and its BLAS.
Run: .venv/bin/python -m pytest tests/test_model.py -q
"""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from configs.schema import ModelConfig
from data.tokenizer import EOT, document_ids
from model import ATTENTIONS, GPT, get_attention
from model.gpt import Rotary
from tests.helpers import assert_within_own_error, tiny_config


def twin_models(cfg: ModelConfig, attns: tuple[str, ...], dtype: torch.dtype, window: int = 0) -> list[GPT]:
    models = []
    for attn in attns:
        torch.manual_seed(0)  # identical weights: only the attention differs
        models.append(GPT(cfg, attn, window=window).to(dtype))
    return models


def logits_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None):
    with torch.no_grad():
        logits, _ = model(idx, doc_ids=doc_ids)
    _, loss = model(idx, targets, doc_ids=doc_ids)
    loss.backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def test_shapes_and_padded_vocab():
    model = GPT(tiny_config(), "sdpa")
    assert model.vocab_size == 50304
    idx = torch.randint(0, 50257, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 50304) and loss is None


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_initial_loss_is_uniform(pos_emb):
    # GPT-2 init gives near-uniform predictions: loss ~ ln(vocab), not the >> value of a bad init
    torch.manual_seed(1)
    model = GPT(tiny_config(pos_emb=pos_emb), "sdpa")
    idx = torch.randint(0, 50257, (4, 64))
    _, loss = model(idx, torch.randint(0, 50257, (4, 64)))
    assert abs(loss.item() - math.log(50304)) < 0.1


def naive_equals_sdpa_float64(cfg: ModelConfig, idx: torch.Tensor, targets: torch.Tensor, window: int = 0,
                              doc_ids: torch.Tensor | None = None):
    """Asserts naive and sdpa give the same logits and gradients in float64; returns sdpa's."""
    naive, sdpa = (logits_and_grads(m, idx, targets, doc_ids)
                   for m in twin_models(cfg, ("naive", "sdpa"), torch.float64, window))
    torch.testing.assert_close(naive[0], sdpa[0], rtol=1e-10, atol=1e-12)
    for name in naive[1]:
        torch.testing.assert_close(naive[1][name], sdpa[1][name], rtol=1e-9, atol=1e-12, msg=name)
    return sdpa


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_naive_and_sdpa_same_logits_and_grads_float64(pos_emb):
    gen = torch.Generator().manual_seed(2)
    idx, targets = (torch.randint(0, 50257, (2, 37), generator=gen) for _ in range(2))
    naive_equals_sdpa_float64(tiny_config(pos_emb=pos_emb), idx, targets)


@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_grouped_kv_heads_are_the_same_function_in_every_attention(n_kv_head):
    # naive repeats the kv heads, sdpa takes enable_gqa, triton reads kv head h // group: the same
    # function, with a projection of n_head + 2 n_kv_head heads
    cfg = tiny_config(n_head=4, n_kv_head=n_kv_head, pos_emb="rope")
    model = GPT(cfg, "sdpa")
    assert model.blocks[0].attn.qkv.weight.shape == ((4 + 2 * n_kv_head) * 16, 64)
    gen = torch.Generator().manual_seed(4)
    idx, targets = (torch.randint(0, 50257, (2, 37), generator=gen) for _ in range(2))
    sdpa = naive_equals_sdpa_float64(cfg, idx, targets)
    triton, own = (logits_and_grads(m, idx, targets) for m in twin_models(cfg, ("triton", "sdpa"), torch.float32))
    assert_same_function(triton, own, sdpa, longest_sum(cfg, idx))


@pytest.mark.parametrize("window, docs", [(1, False), (9, False), (6, True)], ids=["w1", "w9", "w6-docs"])
def test_a_sliding_window_is_the_same_function_in_every_attention(window, docs):
    # naive and sdpa mask the (T x T) scores densely, triton skips the tiles outside the window:
    # the same function, with GQA, and within documents too
    cfg = tiny_config(n_head=4, n_kv_head=2, pos_emb="rope")
    if docs:
        idx, _ = _packed([5, 1, 20, 11], seed=5)
        idx = idx.expand(2, -1)
    else:
        idx = torch.randint(0, 50257, (2, 37), generator=torch.Generator().manual_seed(5))
    targets = torch.roll(idx, -1, dims=1)
    doc_ids = document_ids(idx) if docs else None
    sdpa = naive_equals_sdpa_float64(cfg, idx, targets, window, doc_ids)
    full = logits_and_grads(twin_models(cfg, ("sdpa",), torch.float64)[0], idx, targets, doc_ids)
    assert not torch.allclose(full[0], sdpa[0], rtol=1e-3, atol=1e-4)  # the window matters here
    triton, own = (logits_and_grads(m, idx, targets, doc_ids)
                   for m in twin_models(cfg, ("triton", "sdpa"), torch.float32, window))
    assert_same_function(triton, own, sdpa, longest_sum(cfg, idx))


def test_a_window_as_long_as_the_sequence_is_plain_causal_attention():
    idx = torch.randint(0, 50257, (2, 20))
    plain, windowed = (twin_models(tiny_config(), ("sdpa",), torch.float32, w)[0] for w in (0, 20))
    assert torch.equal(plain(idx)[0], windowed(idx)[0])
    assert GPT(tiny_config(), "sdpa", window=8).flops_per_token(64) < plain.flops_per_token(64)


def test_as_many_kv_heads_as_query_heads_is_plain_attention():
    # n_kv_head = n_head lays the projection out as n_kv_head = 0 does: the same weights, the same model
    torch.manual_seed(0)
    plain = GPT(tiny_config(), "sdpa")
    torch.manual_seed(0)
    same = GPT(tiny_config(n_kv_head=4), "sdpa")
    idx = torch.randint(0, 50257, (2, 20))
    assert torch.equal(plain(idx)[0], same(idx)[0])


def test_triton_matches_sdpa_in_the_model():
    # float32 through the interpreter (IEEE dots) against SDPA's float32 and float64 runs
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=40)
    gen = torch.Generator().manual_seed(3)
    idx, targets = (torch.randint(0, 50257, (2, 40), generator=gen) for _ in range(2))
    triton, sdpa = (logits_and_grads(m, idx, targets) for m in twin_models(cfg, ("triton", "sdpa"), torch.float32))
    ref = logits_and_grads(twin_models(cfg, ("sdpa",), torch.float64)[0], idx, targets)
    assert_same_function(triton, sdpa, ref, longest_sum(cfg, idx))


def longest_sum(cfg: ModelConfig, idx: torch.Tensor, backward: bool = True) -> int:
    """Terms in the longest sum a forward (and backward) adds: the MLP's 4 d inputs and a row's keys;
    in the backward also the batch's tokens (weight gradients) and the vocabulary (dX of the head)."""
    forward = max(4 * cfg.d_model, idx.size(-1))
    return max(forward, idx.numel(), cfg.vocab_size) if backward else forward


def assert_same_function(got, own, ref64, n_terms: int, dtype: torch.dtype = torch.float32) -> None:
    """Logits and every gradient of `got` within float32's error of `ref64` (see the module docstring)."""
    assert_within_own_error("logits", got[0], ref64[0], own[0], n_terms, dtype)
    for name in ref64[1]:
        assert_within_own_error(name, got[1][name], ref64[1][name], own[1][name], n_terms, dtype)


def test_unknown_attention_lists_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of .*fa4.*flex.*naive.*sdpa.*triton"):
        get_attention("flash")
    assert set(ATTENTIONS) == {"naive", "sdpa", "triton", "flex", "fa4"}


def test_sequence_longer_than_positions_is_refused():
    model = GPT(tiny_config(max_seq_len=16), "sdpa")
    with pytest.raises(ValueError, match="max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_residual_projections_are_scaled():
    torch.manual_seed(4)
    cfg = tiny_config(n_layer=8, d_model=256)
    model = GPT(cfg, "sdpa")
    std_proj = model.blocks[0].mlp.proj.weight.std().item()
    std_fc = model.blocks[0].mlp.fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.001


class Float32Dropout(nn.Module):
    """Dropout whose mask is drawn as for a float32 tensor of x's shape: from the same RNG state a
    float64 model drops exactly what the float32 model drops (the mask depends on the dtype)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * F.dropout(torch.ones(x.shape, dtype=torch.float32), self.p).to(x.dtype)


def float64_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, rng: torch.Tensor):
    """(loss, grads) of `model`'s weights in float64: SDPA, the textbook loss, no checkpointing, and
    the dropout masks the model draws from RNG state `rng`."""
    twin = GPT(dataclasses.replace(model.cfg, loss="full"), "sdpa").double()
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, name, Float32Dropout(child.p))
    torch.set_rng_state(rng)
    _, loss = twin(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in twin.named_parameters()}


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_checkpointing_and_the_chunked_loss_change_nothing_but_memory(attn):
    # fp32, dropout on (checkpointing must replay the same masks), two AdamW steps: at every step
    # the loss and gradients of ac=selective, ac=full and the chunked loss are as close to float64
    # as the textbook path's (ac=none, full loss) are. Each run's float64 reference is taken at its
    # own weights: AdamW turns last-bit gradient differences into larger weight differences
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=40, dropout=0.1, loss_chunk=23)
    gen = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, 50257, (2, 40), generator=gen) for _ in range(2)) for _ in range(2)]

    def run(ac, loss, mlp_chunk=0):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, loss=loss, mlp_chunk=mlp_chunk), attn, ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        history = []
        for idx, targets in batches:
            rng = torch.get_rng_state()
            ref = float64_step(model, idx, targets, rng)
            torch.set_rng_state(rng)
            _, value = model(idx, targets)
            value.backward()
            history.append(((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), ref))
            opt.step()
            opt.zero_grad()
        return history

    textbook = run("none", "full")
    # the chunked loss's dX = dZ W sums over the vocabulary one chunk of tokens at a time: the BLAS
    # blocks (and so rounds) that sum by the chunk's size, so its floor is that of V terms
    n_terms = longest_sum(cfg, batches[0][0])
    # the tiled MLP (15-token chunks of 40) draws its dropout masks chunk by chunk, as its float64 twin does
    for ac, loss, mlp_chunk in (("none", "chunked", 0), ("selective", "chunked", 0), ("full", "chunked", 0),
                                ("offload", "chunked", 0), ("none", "full", 15), ("offload", "chunked", 15)):
        for step, ((got, ref), (own, own_ref)) in enumerate(zip(run(ac, loss, mlp_chunk), textbook, strict=True)):
            where = f"ac={ac} loss={loss} mlp_chunk={mlp_chunk} step {step}"
            assert_within_own_error(f"{where} loss", got[0], ref[0], own[0], n_terms, own_ref64=own_ref[0])
            for name in got[1]:
                assert_within_own_error(f"{where} {name}", got[1][name], ref[1][name], own[1][name], n_terms,
                                        own_ref64=own_ref[1][name])


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_offload_and_the_tiled_mlp_match_no_checkpointing(attn):
    # fp32, two AdamW steps: ac=offload computes what ac=full does, bit for bit (the block inputs
    # come back unchanged); the tiled MLP, alone or with offload, gives ac=none's losses and
    # gradients to 1e-6 (its weight gradients are sums over chunks: fp32 rounding only)
    cfg = tiny_config(n_layer=3, n_head=2, d_model=32, max_seq_len=40, pos_emb="rope", loss_chunk=23)
    gen = torch.Generator().manual_seed(7)
    batches = [tuple(torch.randint(0, 50257, (2, 40), generator=gen) for _ in range(2)) for _ in range(2)]

    def run(ac, mlp_chunk=0):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, mlp_chunk=mlp_chunk), attn, ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        history = []
        for idx, targets in batches:
            _, loss = model(idx, targets)
            loss.backward()
            history.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        return history

    for (full_loss, full_grads), (loss, grads) in zip(run("full"), run("offload"), strict=True):
        assert torch.equal(loss, full_loss) and all(torch.equal(grads[n], full_grads[n]) for n in grads)
    plain = run("none")
    for ac, mlp_chunk in (("none", 16), ("offload", 16), ("offload", 7)):
        for step, ((loss, grads), (want, want_grads)) in enumerate(zip(run(ac, mlp_chunk), plain, strict=True)):
            where = f"ac={ac} mlp_chunk={mlp_chunk} step {step}"
            assert (loss - want).abs() <= 1e-6 * want.abs(), where
            for n, g in grads.items():
                assert (g - want_grads[n]).abs().max() <= 1e-6 * want_grads[n].abs().max(), f"{where} {n}"


@pytest.mark.gpu
def test_gpu_offload_and_the_tiled_mlp_lower_the_peak():
    # bf16 autocast, one sequence of 16,384 tokens, 6 layers: ac=offload holds two blocks' fp32
    # inputs on the GPU where ac=full holds six, and computes the same loss and gradients; the
    # tiled MLP (2,048-token chunks) takes away at least one (T, 4C) bf16 hidden activation. A 1,024-token vocabulary keeps the loss's chunk of logits (loss_chunk x V
    # fp32) below the blocks' memory, which would otherwise set the peak
    T, C, L, V = 16384, 256, 6, 1024
    cfg = tiny_config(n_layer=L, n_head=4, d_model=C, max_seq_len=T, pos_emb="rope", vocab_size=V)
    idx, targets = torch.randint(0, V, (2, 1, T), device="cuda")

    def run(ac, mlp_chunk=0):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, mlp_chunk=mlp_chunk), "triton", ac).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, targets)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated() - base

    (full_loss, full_grads, full), (loss, grads, offload) = run("full"), run("offload")
    assert torch.equal(loss, full_loss) and all(torch.equal(grads[n], full_grads[n]) for n in grads)
    _, _, tiled = run("offload", 2048)
    print(f"peak above the weights, MiB: full {full / 2**20:.0f}, offload {offload / 2**20:.0f}, "
          f"offload + tiled MLP {tiled / 2**20:.0f}")
    assert full - offload >= (L - 3) * T * C * 4
    assert offload - tiled >= T * 4 * C * 2


def test_rotary_angles_are_exact_at_a_million_positions():
    # cos and sin of position * frequency, against float64 math, at the far end of a 2^20 table
    rotary = Rotary(head_dim=64, max_seq_len=2**20, theta=10000.0)
    positions = torch.tensor([0, 1, 777_777, 2**20 - 1])
    freqs = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = positions.double()[:, None] * freqs
    assert (rotary.cos[positions].double() - angles.cos()).abs().max() < 1e-6
    assert (rotary.sin[positions].double() - angles.sin()).abs().max() < 1e-6


def _packed(lengths, seed):
    """(1, T) tokens of consecutive documents of the given lengths, each ended by end-of-text."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(0, 50256, (n - 1,), generator=gen), torch.tensor([EOT])]) for n in lengths]
    return torch.cat(docs)[None], docs


def test_document_ids_follow_the_end_of_text_tokens():
    idx, _ = _packed([3, 1, 4], seed=0)
    assert document_ids(idx).tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]


def test_every_attention_masks_documents_alike():
    # fp32: naive's dense mask and the Triton kernels' block-sparse mask against SDPA's attn_mask,
    # in fp32 and in float64
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=64)
    idx, _ = _packed([5, 1, 20, 13, 9], seed=1)
    targets = torch.roll(idx, -1, dims=1)
    results = {}
    for attn, dtype in (("naive", torch.float32), ("sdpa", torch.float32), ("triton", torch.float32),
                        ("sdpa64", torch.float64)):
        torch.manual_seed(0)
        results[attn] = logits_and_grads(GPT(cfg, attn.removesuffix("64")).to(dtype), idx, targets, document_ids(idx))
    torch.manual_seed(0)
    unmasked = logits_and_grads(GPT(cfg, "sdpa"), idx, targets)
    assert not torch.allclose(unmasked[0], results["sdpa"][0], rtol=1e-3, atol=1e-4)  # the mask matters here
    for attn in ("naive", "triton"):
        assert_same_function(results[attn], results["sdpa"], results["sdpa64"], longest_sum(cfg, idx))


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_a_packed_document_scores_as_if_it_were_alone(attn):
    # with RoPE, attention within a document depends on relative positions only: each document's
    # token logits in a packed sequence equal those of the document run on its own, to fp32
    # rounding: Rotary rotates in fp32 from fp32 tables whatever the model's dtype, so another
    # offset rounds q and k differently even in a float64 model (float64 where the attention
    # takes it; the Triton kernels take fp32)
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=64, pos_emb="rope", loss="full")
    torch.manual_seed(0)
    dtype = torch.float32 if attn == "triton" else torch.float64
    model = GPT(cfg, attn).to(dtype)
    reference = GPT(cfg, "sdpa").double()
    reference.load_state_dict(model.state_dict())
    idx, docs = _packed([9, 1, 17, 12], seed=2)
    with torch.no_grad():
        packed = model(idx, doc_ids=document_ids(idx))[0][0]  # (T, V)
        start = 0
        for doc in docs:
            alone, exact = (m(doc[None], doc_ids=document_ids(doc[None]))[0][0] for m in (model, reference))
            assert_within_own_error(f"document at {start}", packed[start:start + len(doc)], exact, alone,
                                    longest_sum(cfg, idx, backward=False))
            start += len(doc)
