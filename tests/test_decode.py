"""Generation with a KV cache: the FlashDecoding kernel (kernels/decode.py) against float64 attention
over the same cache, and GPT.generate with the cache (model/kv_cache.py) token for token against
generation that recomputes every window.

On CPU the kernel runs in Triton's interpreter (fp32 and fp16; bf16 is computed in fp32 there),
with and without the score modifications and sinks (kernels/score_mods.py); the test_gpu_* tests
check bf16 at caches of 8k and 128k positions, with the modifications too, a decode step replayed
in a CUDA graph and generation through one. Run: .venv/bin/python -m pytest tests/test_decode.py -q
"""

import pytest
import torch

from kernels.decode import decode_attention
from kernels.reference.flash_ref import attention_reference
from kernels.score_mods import ScoreMods
from model import GPT
from model.kv_cache import dense_decode, triton_decode
from tests.helpers import tiny_config

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _cache_inputs(B, H, H_kv, T, length, max_len, D, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(B, H_kv, max_len, D, generator=gen, device=device).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor([length], dtype=torch.int32, device=device)


def _sinks(H, dtype, device="cpu", seed=1):
    # around log of a few tens of keys' exp(score): a sink that takes a visible share of each row
    gen = torch.Generator(device=device).manual_seed(seed)
    return (3 + 2 * torch.randn(H, generator=gen, device=device)).to(dtype)


def _check(B, H, H_kv, T, length, max_len, D, dtype, window=0, splits=None, device="cpu", mods=None, sinks=False):
    """The kernel's output against float64 attention of the T newest queries over the filled keys:
    within 2x PyTorch's own dense error in `dtype` plus one ulp of the result (as tests/test_flash_attn.py)."""
    q, k, v, n = _cache_inputs(B, H, H_kv, T, length, max_len, D, dtype, device)
    sink = _sinks(H, dtype, device) if sinks else None
    got = decode_attention(q, k, v, n, window=window, splits=splits, mods=mods, sinks=sink)
    assert got.dtype == dtype and got.shape == q.shape
    _within_bound(got, q, k[:, :, :length], v[:, :, :length], window, mods, sink)


def _within_bound(got, q, k, v, window, mods=None, sinks=None):
    dtype = q.dtype
    ref64, _ = attention_reference(q, k, v, causal=True, window=window, mods=mods, sinks=sinks)
    own, _ = attention_reference(q, k, v, causal=True, window=window, dtype=dtype if dtype != BF16 else F32,
                                 mods=mods, sinks=sinks)
    own_error = (own.double() - ref64).abs().max().item()
    bound = 2 * own_error + torch.finfo(dtype).eps * ref64.abs().max().item()
    error = (got.double() - ref64).abs().max().item()
    assert torch.isfinite(got).all() and error <= bound, (error, bound)


# (B, H, H_kv, T new rows, length, max_len, D, dtype, window, splits): one new row against caches
# of lengths that are not multiples of the CPU tile (16), several new rows (causal among
# themselves), GQA and MQA (the group's rows share one tile), windows of one key and of more,
# more splits than tiles (empty splits), head dims that are not powers of two
CPU_CASES = [
    (2, 4, 4, 1, 100, 130, 32, F32, 0, 3),
    (1, 4, 1, 3, 77, 77, 48, F32, 0, None),
    (2, 4, 2, 1, 200, 256, 64, F16, 30, 4),
    (1, 2, 2, 2, 50, 64, 16, F32, 1, 2),
    (1, 4, 2, 1, 5, 64, 40, F32, 0, 8),
    (3, 6, 3, 4, 33, 40, 24, F16, 9, None),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-kv{c[2]}-T{c[3]}-L{c[4]}-W{c[8]}")
def test_decode_kernel_matches_float64_reference(case):
    B, H, H_kv, T, length, max_len, D, dtype, window, splits = case
    _check(B, H, H_kv, T, length, max_len, D, dtype, window, splits)


# (B, H, H_kv, T, length, max_len, D, dtype, window, splits, softcap, alibi, sinks): each alone, then
# together with GQA and MQA, windows, several new rows (ALiBi's query position is each row's own),
# several splits (the sink counted once per row, not per split), 6 heads (ALiBi's slopes past a
# power of two) and bf16. Caps of a few units bend scores of randn inputs visibly
MOD_CASES = [
    (2, 4, 4, 1, 100, 130, 32, F32, 0, 3, 2.0, False, False),
    (1, 4, 2, 1, 77, 96, 32, F32, 0, 4, 0.0, True, False),
    (2, 4, 1, 1, 60, 64, 16, F16, 0, 2, 0.0, False, True),
    (1, 8, 2, 3, 90, 100, 32, F32, 20, 5, 3.0, True, True),
    (2, 6, 3, 2, 50, 64, 24, F16, 0, None, 1.5, True, True),
    (1, 4, 4, 4, 40, 40, 16, BF16, 9, 3, 2.0, True, True),
]


@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: f"cap{c[10]:g}-alibi{int(c[11])}-sinks{int(c[12])}-"
                                                      f"H{c[1]}-kv{c[2]}-T{c[3]}-W{c[8]}-{str(c[7])[6:]}")
def test_decode_kernel_with_score_mods_and_sinks_matches_float64_reference(case):
    *shape, window, splits, softcap, alibi, sinks = case
    _check(*shape, window, splits, mods=ScoreMods(softcap, alibi), sinks=sinks)


def test_decode_kernel_with_mods_off_is_the_kernel_without_them():
    q, k, v, n = _cache_inputs(2, 4, 2, 2, 70, 80, 32, F32)
    plain = decode_attention(q, k, v, n, window=30, splits=3)
    for off in ({"mods": None, "sinks": None}, {"mods": ScoreMods()}, {"mods": ScoreMods(0.0, False)}):
        assert torch.equal(decode_attention(q, k, v, n, window=30, splits=3, **off), plain), off


def test_decode_kernel_counts_a_sink_once_whatever_the_splits():
    # the split count only regroups the keys: with the sink in the merge, once, the outputs agree
    q, k, v, n = _cache_inputs(1, 4, 2, 1, 96, 96, 16, F32)
    mods, sinks = ScoreMods(2.0, True), _sinks(4, F32)
    one = decode_attention(q, k, v, n, splits=1, mods=mods, sinks=sinks)
    for splits in (2, 6):
        torch.testing.assert_close(decode_attention(q, k, v, n, splits=splits, mods=mods, sinks=sinks), one)


def test_decode_paths_pass_the_mods_and_sinks_on():
    calls = []

    def attend(q, k, v, window=0, **extra):
        calls.append(extra)
        return q

    q, k, v, n = _cache_inputs(1, 4, 2, 1, 10, 16, 16, F32)
    mods, sinks = ScoreMods(5.0, True), _sinks(4, F32)
    dense_decode(q, k, v, n, 10, 0, attend=attend)
    dense_decode(q, k, v, n, 10, 0, attend=attend, mods=ScoreMods(), sinks=None)  # off: an attend without them works
    dense_decode(q, k, v, n, 10, 0, attend=attend, mods=mods)
    dense_decode(q, k, v, n, 10, 0, attend=attend, sinks=sinks)
    assert calls[:3] == [{}, {}, {"mods": mods}] and calls[3].keys() == {"sinks"} and calls[3]["sinks"] is sinks
    assert torch.equal(triton_decode(q, k, v, n, 10, 4, mods=mods, sinks=sinks),
                       decode_attention(q, k, v, n, 4, mods=mods, sinks=sinks))


def test_decode_kernel_reads_no_key_past_the_length_nor_before_the_window():
    # NaN in every cache position past the filled ones and before the window's first key: any
    # that was read would turn the output NaN (0 * NaN), not only mask it
    q, k, v, n = _cache_inputs(2, 4, 2, 1, 90, 128, 32, F32)
    window = 40
    clean = decode_attention(q, k, v, n, window=window, splits=3)
    for t in (k, v):
        t[:, :, 90:] = float("nan")
        t[:, :, :32] = float("nan")  # the window starts at key 50: tiles of 16 from 48 on
    poisoned = decode_attention(q, k, v, n, window=window, splits=3)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


def test_decode_kernel_says_what_it_takes():
    q, k, v, n = _cache_inputs(1, 4, 3, 1, 8, 16, 16, F32)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        decode_attention(q, k, v, n)
    q, k, v, n = _cache_inputs(1, 4, 2, 1, 8, 16, 16, F32)
    with pytest.raises(ValueError, match="one-element int32 tensor"):
        decode_attention(q, k, v, n.long())
    q, k, v, n = _cache_inputs(1, 4, 1, 33, 40, 40, 16, F32)
    with pytest.raises(ValueError, match="4 query heads per kv head x 33 new rows exceed the 128 rows"):
        decode_attention(q, k, v, n)
    q, k, v, n = _cache_inputs(1, 4, 2, 1, 8, 16, 16, F32)
    with pytest.raises(ValueError, match=r"sinks \(2,\) on cpu: need one logit per query head, \(4,\)"):
        decode_attention(q, k, v, n, sinks=torch.zeros(2))


@pytest.mark.parametrize("attn, kv_heads, window, pos_emb, prompt", [
    ("naive", 0, 0, "learned", 5), ("sdpa", 2, 5, "rope", 5), ("sdpa", 1, 0, "learned", 1), ("triton", 2, 5, "rope", 5),
])
def test_greedy_generation_with_the_cache_is_token_identical(attn, kv_heads, window, pos_emb, prompt):
    # past max_seq_len (12) both recompute the last 12 tokens' forward per token: identical there too
    torch.manual_seed(0)
    model = GPT(tiny_config(n_kv_head=kv_heads, pos_emb=pos_emb, max_seq_len=12), attn, window=window).eval()
    idx = torch.randint(0, 50257, (2, prompt), generator=torch.Generator().manual_seed(1))
    new = 10 if attn == "triton" else 16  # the interpreter is slow
    cached = model.generate(idx, new, top_k=1, kv_cache=True)
    recomputed = model.generate(idx, new, top_k=1, kv_cache=False)
    assert cached.shape == (2, prompt + new) and torch.equal(cached, recomputed)


@pytest.mark.gpu
@pytest.mark.parametrize("B, H_kv, length, window", [(1, 12, 8192, 0), (16, 12, 8191, 0), (16, 4, 8192, 1024),
                                                     (1, 12, 131072, 0), (2, 3, 131071, 4096)])
def test_gpu_decode_kernel_matches_float64_reference(B, H_kv, length, window):
    _check(B, 12, H_kv, 1, length, length + 5, 64, BF16, window, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("B, H_kv, length, window, softcap, alibi, sinks", [
    (1, 12, 8192, 0, 20.0, True, True), (16, 4, 8191, 1024, 0.0, True, False), (4, 12, 32768, 0, 5.0, False, True),
    (2, 3, 131071, 4096, 30.0, True, True), (1, 12, 131072, 0, 0.0, False, True)])
def test_gpu_decode_kernel_with_score_mods_and_sinks_matches_float64_reference(B, H_kv, length, window, softcap,
                                                                               alibi, sinks):
    _check(B, 12, H_kv, 1, length, length + 5, 64, BF16, window, device="cuda", mods=ScoreMods(softcap, alibi),
           sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("T, window", [(1, 0), (3, 700)])
def test_gpu_decode_step_with_score_mods_and_sinks_replays_in_a_cuda_graph(T, window):
    # the slopes are made by the eager call before the capture (no host copy while capturing); each
    # replay reads the length the step finds in `n`, as an eager call with that length does
    q, k, v, n = _cache_inputs(2, 8, 2, T, 1000, 4096, 64, BF16, "cuda")
    mods, sinks = ScoreMods(softcap=10.0, alibi=True), _sinks(8, torch.float32, "cuda")
    decode_attention(q, k, v, n, window, mods=mods, sinks=sinks)  # compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = decode_attention(q, k, v, n, window, mods=mods, sinks=sinks)
    for length in (1000, 1777, 4096, 3):
        n.fill_(length)
        graph.replay()
        eager = decode_attention(q, k, v, n, window, mods=mods, sinks=sinks)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), length
        _within_bound(replayed, q, k[:, :, :length], v[:, :, :length], window, mods, sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, window, prompt", [(0, 0, 9), (2, 7, 9), (2, 0, 1)])
def test_gpu_greedy_generation_through_a_cuda_graph_is_token_identical(kv_heads, window, prompt):
    # fp32 (true fp32 matmuls in every kernel): the recomputed forward and the decode kernel add in
    # different orders, which in fp32 moves no argmax of this model. A one-token prompt: the graph is
    # captured only after an eager decode step, never right after the prompt's forward
    torch.manual_seed(0)
    model = GPT(tiny_config(n_kv_head=kv_heads, max_seq_len=48), "triton", window=window).cuda().eval()
    idx = torch.randint(0, 50257, (3, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    graphed = model.generate(idx, 60, top_k=1, kv_cache=True, cuda_graph=True)
    eager = model.generate(idx, 60, top_k=1, kv_cache=True, cuda_graph=False)
    recomputed = model.generate(idx, 60, top_k=1, kv_cache=False)
    assert torch.equal(graphed, eager) and torch.equal(graphed, recomputed)


@pytest.mark.gpu
def test_gpu_graph_under_autocast_decodes_as_the_eager_steps_do():
    # fp32 weights under bf16 autocast, as scripts/sample.py runs them: the graph reads the casts the
    # eager decode step left in autocast's cache, and replays exactly the eager steps' kernels
    torch.manual_seed(0)
    model = GPT(tiny_config(n_kv_head=2, max_seq_len=48), "triton").cuda().eval()
    idx = torch.randint(0, 50257, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed = model.generate(idx, 30, top_k=1)
        eager = model.generate(idx, 30, top_k=1, cuda_graph=False)
    assert torch.equal(graphed, eager)
