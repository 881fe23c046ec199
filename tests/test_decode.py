"""Generation with a KV cache: the FlashDecoding kernel (kernels/decode.py) against float64 attention
over the same cache, and GPT.generate with the cache (model/kv_cache.py) token for token against
generation that recomputes every window.

On CPU the kernel runs in Triton's interpreter (fp32 and fp16; bf16 is computed in fp32 there);
the test_gpu_* tests check bf16 at caches of 8k and 128k positions and generation through a CUDA
graph. Run: .venv/bin/python -m pytest tests/test_decode.py -q
"""

import pytest
import torch

from kernels.decode import decode_attention
from kernels.reference.flash_ref import attention_reference
from model import GPT
from tests.test_model import tiny_config

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _cache_inputs(B, H, H_kv, T, length, max_len, D, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(B, H_kv, max_len, D, generator=gen, device=device).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor([length], dtype=torch.int32, device=device)


def _check(B, H, H_kv, T, length, max_len, D, dtype, window=0, splits=None, device="cpu"):
    """The kernel's output against float64 attention of the T newest queries over the filled keys:
    within 2x PyTorch's own dense error in `dtype` plus one ulp of the result (as tests/test_flash_attn.py)."""
    q, k, v, n = _cache_inputs(B, H, H_kv, T, length, max_len, D, dtype, device)
    got = decode_attention(q, k, v, n, window=window, splits=splits)
    assert got.dtype == dtype and got.shape == q.shape
    keys = (k[:, :, :length], v[:, :, :length])
    ref64, _ = attention_reference(q, *keys, causal=True, window=window)
    own, _ = attention_reference(q, *keys, causal=True, window=window, dtype=dtype if dtype != BF16 else F32)
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
