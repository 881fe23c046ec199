"""The GPT model: shapes, initial loss, that every attention computes the same function, and that
activation checkpointing and the chunked loss change nothing but memory and time.

naive and sdpa are compared in float64 (where both are exact up to rounding), triton through
Triton's CPU interpreter in float32. Run: .venv/bin/python -m pytest tests/test_model.py -q
"""

import dataclasses
import math

import pytest
import torch

from configs.schema import ModelConfig
from model import ATTENTIONS, GPT, get_attention
from data.tokenizer import EOT
from model.gpt import Rotary, document_ids


def tiny_config(**overrides) -> ModelConfig:
    base = dict(name="test", n_layer=2, n_head=4, d_model=64, max_seq_len=64, vocab_size=50257)
    return ModelConfig(**{**base, **overrides})


def twin_models(cfg: ModelConfig, attns: tuple[str, ...], dtype: torch.dtype) -> list[GPT]:
    models = []
    for attn in attns:
        torch.manual_seed(0)  # identical weights: only the attention differs
        models.append(GPT(cfg, attn).to(dtype))
    return models


def logits_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor):
    with torch.no_grad():
        logits, _ = model(idx)
    _, loss = model(idx, targets)
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


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_naive_and_sdpa_same_logits_and_grads_float64(pos_emb):
    cfg = tiny_config(pos_emb=pos_emb)
    gen = torch.Generator().manual_seed(2)
    idx, targets = (torch.randint(0, 50257, (2, 37), generator=gen) for _ in range(2))
    naive, sdpa = (logits_and_grads(m, idx, targets) for m in twin_models(cfg, ("naive", "sdpa"), torch.float64))
    torch.testing.assert_close(naive[0], sdpa[0], rtol=1e-10, atol=1e-12)
    for name in naive[1]:
        torch.testing.assert_close(naive[1][name], sdpa[1][name], rtol=1e-9, atol=1e-12, msg=name)


def test_triton_matches_sdpa_in_the_model():
    # float32 through the interpreter: the kernel computes in fp32 (IEEE dots), SDPA too, so the
    # two differ by accumulation order only; 1e-4 relative is ~100x float32 rounding on these sums
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=40)
    gen = torch.Generator().manual_seed(3)
    idx, targets = (torch.randint(0, 50257, (2, 40), generator=gen) for _ in range(2))
    sdpa, triton = (logits_and_grads(m, idx, targets) for m in twin_models(cfg, ("sdpa", "triton"), torch.float32))
    torch.testing.assert_close(triton[0], sdpa[0], rtol=1e-4, atol=1e-5)
    for name in sdpa[1]:
        assert torch.isfinite(triton[1][name]).all(), name
        torch.testing.assert_close(triton[1][name], sdpa[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_unknown_attention_lists_the_valid_ones():
    with pytest.raises(ValueError, match="naive.*sdpa.*triton"):
        get_attention("flash")
    assert set(ATTENTIONS) == {"naive", "sdpa", "triton"}


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


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_checkpointing_and_the_chunked_loss_change_nothing_but_memory(attn):
    # fp32, dropout on (checkpointing must replay the same masks): losses and gradients of a few
    # AdamW steps with ac=selective and ac=full, and with the full loss, equal ac=none's to 1e-6
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=40, dropout=0.1, loss_chunk=23)
    gen = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, 50257, (2, 40), generator=gen) for _ in range(2)) for _ in range(3)]

    def run(ac, loss):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, loss=loss), attn, ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        history = []
        for idx, targets in batches:
            _, value = model(idx, targets)
            value.backward()
            history.append((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        return history

    reference = run("none", "chunked")
    # checkpointing over three steps; the full loss on the first (AdamW then amplifies the
    # last-bit differences of two summation orders in the weights it updates)
    for ac, loss, steps in (("selective", "chunked", 3), ("full", "chunked", 3), ("none", "full", 1)):
        for (value, grads), (ref_value, ref_grads) in zip(run(ac, loss)[:steps], reference[:steps], strict=True):
            torch.testing.assert_close(value, ref_value, rtol=1e-6, atol=0, msg=f"{ac} {loss} loss")
            for name in grads:
                scale = ref_grads[name].abs().max()
                assert (grads[name] - ref_grads[name]).abs().max() <= 1e-6 * scale, (ac, loss, name)


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
    # fp32: naive's dense mask, SDPA's attn_mask and the Triton kernels' block-sparse mask
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=64)
    idx, _ = _packed([5, 1, 20, 13, 9], seed=1)
    targets = torch.roll(idx, -1, dims=1)
    results = {}
    for attn in ("naive", "sdpa", "triton"):
        torch.manual_seed(0)
        results[attn] = logits_and_grads(GPT(cfg, attn, doc_mask=True), idx, targets)
    torch.manual_seed(0)
    unmasked = logits_and_grads(GPT(cfg, "sdpa"), idx, targets)
    assert not torch.allclose(unmasked[0], results["sdpa"][0], rtol=1e-3, atol=1e-4)  # the mask matters here
    for attn in ("naive", "triton"):
        torch.testing.assert_close(results[attn][0], results["sdpa"][0], rtol=1e-4, atol=1e-5)
        for name, grad in results[attn][1].items():
            torch.testing.assert_close(grad, results["sdpa"][1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_a_packed_document_scores_as_if_it_were_alone(attn):
    # with RoPE, attention within a document depends on relative positions only: each document's
    # token losses in a packed sequence equal those of the document run on its own
    cfg = tiny_config(n_layer=2, n_head=2, d_model=32, max_seq_len=64, pos_emb="rope", loss="full")
    torch.manual_seed(0)
    # float64 where the attention takes it (exact to rounding); the Triton kernels take fp32
    dtype, tol = (torch.float32, 1e-5) if attn == "triton" else (torch.float64, 1e-9)
    model = GPT(cfg, attn, doc_mask=True).to(dtype)
    idx, docs = _packed([9, 1, 17, 12], seed=2)
    with torch.no_grad():
        packed = model(idx)[0][0]  # (T, V)
        start = 0
        for doc in docs:
            alone = model(doc[None])[0][0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, rtol=tol, atol=tol)
            start += len(doc)
