"""The Triton FlashAttention-2 kernels (kernels/triton/) compute attention and its gradients.

Proves, for every element of O, LSE, dQ, dK and dV, against dense float64 attention with an
explicit mask (kernels/reference/flash_ref.py), that the kernels' error is at most twice the error of
PyTorch's own dense attention in the input dtype, plus a floor for rounding to that dtype and
for fp32 accumulation (tests/helpers.py: assert_within_reference_error); NaN or inf never passes. Shapes
cover T and S in {1, 17, 64, 100, 129} (T < S, T == S, and T > S, whose first rows see no
key), head dims 8 to 256 including non-powers of two, causal and not, H_kv = H, H / 2 and 1,
contiguous inputs, transposed (B, T, H, D) views and slices of one packed qkv tensor. Also:
the backward is bit-identical run to run; bad inputs raise ValueError saying what is
supported; torch.compile(fullgraph=True) traces through the custom ops; autocast casts the
inputs; incoming gradients that are expanded or transposed views are read correctly.

On CPU the kernels run in Triton's interpreter on small shapes, in fp32 and fp16 (the
interpreter cannot do bf16 matmuls, so bf16 is computed in fp32 there); the file takes one
to two minutes on 2 cores:

    .venv/bin/python -m pytest tests/test_flash_attn.py -q

The test_gpu_* tests (skipped without CUDA) check bf16 and fp16 up to T = 8192 and D in
{64, 80, 96, 128, 256}, GQA, autocast and inductor, and every block/warp/stage config that
autotuning may pick for D = 64 and 256 (autotuning itself is off in these tests: conftest.py
sets FLASH_ATTENTION_AUTOTUNE=0). On Hopper they run the TMA path, and the pointer path where
TMA cannot read the inputs (and, forced by the pointer_loads fixture, where it could); run them
on a CUDA machine with the same command. The TMA path also runs here, in the interpreter, forced on.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch
import triton

import kernels
from kernels import LAUNCHERS, backends, inputs
from kernels.reference.flash_ref import attention_reference
from kernels.runtime import chips
from kernels.runtime.launch import PREPARED
from tests.helpers import (REPO, assert_right_where_seen, assert_within_reference_error, case_id, check_against_float64,
                           dense_reference, doc_ids_of, error_scales, make_inputs, poisoned)


# These are the portable Triton kernels' tests, on every GPU: tests/test_hopper.py checks the Hopper
# kernels (backend="gluon", and "auto" where it picks them)
flash_attention = functools.partial(kernels.flash_attention, backend="triton")
flash_attn_forward = functools.partial(kernels.flash_attn_forward, backend="triton")
flash_attn_backward = functools.partial(kernels.flash_attn_backward, backend="triton")


@pytest.fixture
def pointer_loads(monkeypatch):
    """The pointer loads where TMA could read the inputs (what a GPU before sm_90 runs): the launches
    made meanwhile, kept per input signature, are dropped after, and those made before too."""
    def drop_launches():
        PREPARED.clear()
        backends._CHOSEN.clear()

    monkeypatch.setattr(inputs, "uses_tma", lambda *tensors: False)
    drop_launches()
    yield
    drop_launches()


# --------------------------------------------------------------------------------------------
# helpers


# --------------------------------------------------------------------------------------------
# correctness on CPU (interpreter)

F32, F16 = torch.float32, torch.float16
# (dtype, B, H, H_kv, T, S, D, causal, layout): every T and S value as T and as S, below, equal
# to and above the other, every head dim, each GQA mode, causal and not, both dtypes, all layouts
CPU_CASES = [
    (F32, 2, 4, 4, 17, 17, 16, True, "contiguous"),
    (F32, 2, 4, 4, 64, 64, 32, True, "packed"),
    (F32, 2, 4, 2, 100, 100, 48, True, "bthd"),
    (F32, 1, 4, 1, 129, 129, 64, True, "bthd"),
    (F32, 2, 4, 4, 129, 129, 80, False, "packed"),
    (F32, 2, 4, 2, 1, 1, 16, True, "contiguous"),
    (F32, 1, 4, 4, 1, 129, 32, True, "bthd"),
    (F32, 1, 4, 2, 129, 1, 48, True, "contiguous"),
    (F32, 2, 4, 1, 17, 100, 64, True, "bthd"),
    (F32, 2, 4, 4, 100, 17, 80, True, "contiguous"),
    (F32, 1, 4, 2, 64, 129, 16, False, "bthd"),
    (F32, 2, 4, 4, 129, 64, 32, False, "contiguous"),
    (F32, 1, 4, 1, 100, 64, 80, True, "bthd"),
    (F32, 2, 4, 2, 17, 1, 64, False, "contiguous"),
    (F32, 1, 4, 4, 64, 17, 48, True, "bthd"),
    (F32, 1, 2, 2, 100, 129, 80, False, "bthd"),
    (F32, 1, 2, 2, 33, 33, 256, True, "bthd"),
    (F32, 1, 2, 2, 50, 40, 96, False, "contiguous"),
    (F16, 2, 4, 4, 17, 17, 16, True, "bthd"),
    (F16, 2, 4, 2, 64, 64, 32, False, "contiguous"),
    (F16, 1, 4, 1, 100, 100, 48, True, "packed"),
    (F16, 2, 4, 4, 129, 129, 64, True, "packed"),
    (F16, 1, 4, 2, 129, 129, 80, True, "bthd"),
    (F16, 2, 4, 4, 1, 1, 32, False, "bthd"),
    (F16, 1, 4, 1, 1, 64, 80, True, "contiguous"),
    (F16, 2, 4, 2, 129, 17, 16, True, "bthd"),
    (F16, 1, 4, 4, 17, 129, 48, False, "contiguous"),
    (F16, 2, 4, 2, 100, 64, 64, True, "contiguous"),
    (F16, 1, 4, 1, 64, 100, 32, True, "bthd"),
    (F16, 1, 2, 2, 129, 100, 80, False, "bthd"),
    (F16, 2, 4, 4, 64, 1, 16, True, "contiguous"),
    (F16, 1, 4, 2, 100, 129, 64, False, "contiguous"),
    (F16, 1, 2, 1, 40, 50, 8, True, "bthd"),
    (F16, 1, 2, 2, 65, 65, 128, True, "packed"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(*c)) for c in CPU_CASES])
def test_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    check_against_float64(case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout)


@pytest.mark.parametrize("case", [CPU_CASES[2], CPU_CASES[8], CPU_CASES[16]], ids=lambda c: case_id(*c))
def test_tma_path_in_the_interpreter(case, monkeypatch):
    # On Hopper the kernels stream tiles through TMA descriptors; forcing that path here runs the
    # same code in the interpreter (descriptor offsets, zero fill past the ends, GQA heads)

    monkeypatch.setattr(inputs, "uses_tma", lambda *tensors: True)
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    check_against_float64("tma-" + case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout)


# (dtype, B, H, H_kv, D, layout, document lengths per batch row): one-token documents, documents
# that span tile boundaries or begin mid-tile (CPU tiles are 16 and 32 rows), one document that
# covers everything, GQA, transposed and packed inputs
DOC_CASES = [
    (F32, 2, 4, 2, 32, "bthd", [[1, 30, 5, 64], [100]]),
    (F32, 1, 4, 1, 48, "packed", [[17, 1, 1, 47, 33, 1]]),
    (F16, 2, 2, 2, 64, "contiguous", [[64, 36, 29], [3, 97, 29]]),
    (F32, 1, 2, 2, 80, "bthd", [[7] * 11]),
]


@pytest.mark.parametrize("case", DOC_CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[5]}-{c[6]}")
def test_document_mask_matches_float64_reference(case):
    dtype, B, H, H_kv, D, layout, lengths = case
    T = sum(lengths[0])
    check_against_float64(f"docs-{lengths}", B, H, H_kv, T, T, D, True, dtype, layout, doc_ids=doc_ids_of(lengths))


def test_one_document_is_plain_causal_bit_for_bit():
    q, k, v, do = make_inputs("one-doc", 2, 4, 2, 77, 77, 32, F32, "bthd")
    plain = flash_attention(q, k, v)
    one = flash_attention(q, k, v, doc_ids=torch.zeros(2, 77, dtype=torch.long))
    assert torch.equal(one, plain)
    for a, b in zip(torch.autograd.grad(one, (q, k, v), do), torch.autograd.grad(plain, (q, k, v), do), strict=True):
        assert torch.equal(a, b)


def test_tiles_of_other_documents_are_skipped_not_masked():
    # NaN in one document: a tile of it that another document's rows or keys only masked would
    # still multiply NaN into their sums; a skipped tile is never loaded. Document 0 fills two
    # whole tiles of every kernel on the CPU.
    doc_ids = doc_ids_of([[64, 64]])
    q, k, v, do = make_inputs("skip", 1, 2, 2, 128, 128, 16, F32, "bthd")
    ref = dense_reference(q, k, v, do, True, torch.float64, doc_ids)  # neither document depends on the other
    ref = (ref[0], *ref[2:])  # o, dq, dk, dv
    # the forward and dQ kernels skip the key tiles of document 0 for the rows of document 1
    (v_nan,) = poisoned(v, where=slice(0, 64))
    o = flash_attention(q, k, v_nan, doc_ids=doc_ids)
    assert_right_where_seen((o, *torch.autograd.grad(o, (q,), do)), ref[:2], slice(64, None))
    # the dK/dV kernel skips the query tiles of document 1 for the keys of document 0
    q_nan, do_nan = poisoned(q, do, where=slice(64, None))
    o = flash_attention(q_nan, k, v, doc_ids=doc_ids)
    assert_right_where_seen(torch.autograd.grad(o, (k, v), do_nan), ref[2:], slice(0, 64))


def test_a_document_is_a_run_of_equal_ids():
    # ids that come back later, or that collide once cast to int32, still mean consecutive runs
    q, k, v, _ = make_inputs("runs", 1, 2, 2, 96, 96, 16, F32, "bthd")
    runs = doc_ids_of([[40, 30, 26]])
    expected = flash_attention(q, k, v, doc_ids=runs)
    for ids in (torch.tensor([[0] * 40 + [1] * 30 + [0] * 26]), runs * 2**32 + 3 * 10**9):
        assert torch.equal(flash_attention(q, k, v, doc_ids=ids), expected)


def test_document_ids_must_fit_the_inputs():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"doc_ids must be a \(batch, seq_len\) = \(1, 8\) tensor"):
        flash_attention(q, q, q, doc_ids=torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids needs causal=True"):
        flash_attention(q, q, q, causal=False, doc_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids needs self-attention"):
        flash_attention(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), doc_ids=torch.zeros(1, 8, dtype=torch.long))


# (dtype, B, H, H_kv, T, S, D, layout, window, document lengths or None): a window of one key, windows
# that are not and that are a multiple of the CPU tiles (16 and 32 rows), T < S and T > S (the
# window counts back from each query's diagonal key), MQA, windows within documents
WINDOW_CASES = [
    (F32, 2, 4, 4, 100, 100, 32, "bthd", 1, None),
    (F16, 1, 4, 2, 129, 129, 48, "packed", 23, None),
    (F32, 2, 4, 1, 64, 64, 16, "contiguous", 32, None),
    (F32, 1, 2, 2, 77, 120, 64, "bthd", 30, None),
    (F32, 1, 2, 2, 120, 77, 64, "bthd", 30, None),
    (F32, 2, 4, 2, 101, 101, 32, "bthd", 19, [[30, 1, 50, 20], [101]]),
    (F16, 1, 2, 1, 96, 96, 80, "contiguous", 40, [[7] * 8 + [40]]),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{str(c[0])[6:]}-T{c[4]}-S{c[5]}-W{c[8]}-docs{c[9]}")
def test_sliding_window_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, layout, window, lengths = case
    doc_ids = None if lengths is None else doc_ids_of(lengths)
    check_against_float64(f"window-{case}", B, H, H_kv, T, S, D, True, dtype, layout, doc_ids=doc_ids,
                           window=window)


@pytest.mark.parametrize("T, S", [(77, 77), (50, 77), (77, 50)])
def test_a_window_as_long_as_the_keys_is_plain_causal_bit_for_bit(T, S):
    q, k, v, do = make_inputs("long-window", 1, 4, 2, T, S, 32, F32, "bthd")
    plain = flash_attention(q, k, v)
    plain_grads = torch.autograd.grad(plain, (q, k, v), do)
    for window in (S, S + 9):
        long = flash_attention(q, k, v, window=window)
        assert torch.equal(long, plain)
        for a, b in zip(torch.autograd.grad(long, (q, k, v), do), plain_grads, strict=True):
            assert torch.equal(a, b)


def test_tiles_outside_the_window_are_skipped_not_masked():
    # NaN where no query of a tile's window looks: a tile that was loaded and only masked would
    # still multiply NaN into the sums (0 * NaN); a skipped tile is never loaded. W = 20 on the
    # CPU's 16- and 32-row tiles: queries from 64 on see keys from 45 on, so no kernel loads the
    # key tile [0, 32) for them; keys below 64 are seen by queries up to 83 only, so no kernel
    # loads the query tile [96, 128) for them.
    window = 20
    q, k, v, do = make_inputs("window-skip", 1, 2, 2, 128, 128, 16, F32, "bthd")
    ref = dense_reference(q, k, v, do, True, torch.float64, window=window)
    k_nan, v_nan = poisoned(k, v, where=slice(0, 32))
    o = flash_attention(q, k_nan, v_nan, window=window)
    assert_right_where_seen((o, *torch.autograd.grad(o, (q,), do)), (ref[0], ref[2]), slice(64, None))
    q_nan, do_nan = poisoned(q, do, where=slice(96, None))
    o = flash_attention(q_nan, k, v, window=window)
    assert_right_where_seen(torch.autograd.grad(o, (k, v), do_nan), ref[3:], slice(0, 64))


def test_a_bad_window_says_what_is_allowed():
    q = torch.randn(1, 2, 8, 16)
    for window in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"window={window!r}: must be an int >= 0"):
            flash_attention(q, q, q, window=window)
    with pytest.raises(ValueError, match="window needs causal=True"):
        flash_attention(q, q, q, causal=False, window=4)


def _check_config(launcher, config, D, dtype, device):
    """Run one kernel with `config` (the other two with their own) on causal GQA shapes with
    T > S and T < S, neither a multiple of the blocks."""
    with launcher.pinned(config):
        for T, S in ((117, 75), (75, 117)) if device == "cpu" else ((517, 333), (333, 517)):
            case_id = f"config-{launcher.name}-{config}-{T}-{S}"
            check_against_float64(case_id, 1, 4, 2, T, S, D, True, dtype, "bthd", device)


@pytest.mark.parametrize("kernel", sorted(LAUNCHERS))
@pytest.mark.parametrize("blocks", [(64, 16), (16, 64)], ids=["BM64-BN16", "BM16-BN64"])
def test_other_block_sizes(kernel, blocks):
    # the interpreter's fixed configs cover BLOCK_M < BLOCK_N in the forward and dK/dV kernels
    # and BLOCK_M > BLOCK_N in dQ; here each kernel runs the other way round too
    config = triton.Config({"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    _check_config(LAUNCHERS[kernel], config, 32, F32, "cpu")


def test_bf16_on_cpu_runs_in_fp32():
    # the interpreter's bf16 tl.dot is wrong, so the launchers compute bf16 in fp32 there
    B, H, T, D = 1, 2, 40, 32
    q, k, v, do = make_inputs("bf16-cpu", B, H, H, T, T, D, torch.bfloat16, "bthd")
    o = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref64 = dense_reference(q, k, v, do, True, torch.float64)
    ref_lowp = dense_reference(q, k, v, do, True, torch.bfloat16)
    scales = error_scales(q, k, v, do, True)
    for name, got, want, lowp, scale in zip(("o", "dq", "dk", "dv"), (o, *grads), ref64[:1] + ref64[2:],
                                            ref_lowp[:1] + ref_lowp[2:], scales[:1] + scales[2:], strict=True):
        assert got.dtype == torch.bfloat16, name
        assert_within_reference_error(name, got, want, lowp, torch.bfloat16, T, scale)


# --------------------------------------------------------------------------------------------
# behaviour


def test_backward_is_deterministic():
    # GQA and causal: the dK/dV kernel sums four query heads per kv head, dQ sums over key blocks
    q, k, v, do = make_inputs("determinism", 2, 4, 1, 100, 100, 32, F32, "bthd")

    def grads():
        o = flash_attention(q, k, v, causal=True)
        return torch.autograd.grad(o, (q, k, v), do)

    for first, second in zip(grads(), grads(), strict=True):
        assert torch.equal(first, second)


def test_gradient_views_are_read_in_place():
    # o.sum() hands the backward an expanded dO (all strides 0); dO also arrives transposed
    q, k, v, _ = make_inputs("grad-views", 1, 2, 2, 33, 33, 16, F32, "bthd")
    o = flash_attention(q, k, v, causal=True)
    ones_bthd = torch.ones(1, 33, 2, 16).transpose(1, 2)
    expanded = torch.autograd.grad(o.sum(), (q, k, v), retain_graph=True)
    transposed = torch.autograd.grad(o, (q, k, v), ones_bthd, retain_graph=True)
    contiguous = torch.autograd.grad(o, (q, k, v), ones_bthd.contiguous())
    for a, b, c in zip(expanded, transposed, contiguous, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_output_layout_is_bthd():
    # (B, H, T, D) values in (B, T, H, D) memory: the caller's transpose back is free
    q, k, v, _ = make_inputs("layout", 2, 3, 3, 20, 20, 16, F32, "contiguous")
    o = flash_attention(q, k, v)
    assert o.shape == (2, 3, 20, 16) and o.transpose(1, 2).is_contiguous()


def test_softmax_scale_is_used():
    q, k, v, _ = make_inputs("scale", 1, 2, 2, 24, 24, 16, F32, "contiguous")
    o = flash_attention(q, k, v, causal=False, softmax_scale=0.3)
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), causal=False, scale=0.3)
    assert (o.double() - ref).abs().max() < 1e-5


def _tensor(*shape, dtype=F32):
    return torch.randn(*shape).to(dtype)


BAD_INPUTS = [
    ((_tensor(2, 8, 16), _tensor(2, 8, 16), _tensor(2, 8, 16)), "must be a 4-D tensor"),
    ((_tensor(1, 2, 8, 16), _tensor(1, 2, 8, 16), _tensor(1, 2, 8, 16, dtype=torch.float16)), "share one dtype"),
    ((_tensor(1, 2, 8, 16, dtype=torch.float64),) * 3, "use torch.float16, torch.bfloat16 or torch.float32"),
    ((_tensor(1, 2, 8, 16), _tensor(1, 2, 8, 16), _tensor(1, 2, 9, 16)), "k and v must have one shape"),
    ((_tensor(1, 2, 8, 16), _tensor(2, 2, 8, 16), _tensor(2, 2, 8, 16)), "same batch size and head_dim"),
    ((_tensor(1, 2, 8, 16), _tensor(1, 2, 8, 32), _tensor(1, 2, 8, 32)), "same batch size and head_dim"),
    ((_tensor(1, 4, 8, 16), _tensor(1, 3, 8, 16), _tensor(1, 3, 8, 16)), "multiple of k and v's 3 heads"),
    ((_tensor(1, 2, 8, 264),) * 3, "head_dim must be at most 256"),
    ((_tensor(1, 2, 0, 16),) * 3, "every dimension must be at least 1"),
]


@pytest.mark.parametrize(("inputs", "message"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_unsupported_input_raises(inputs, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*inputs)


def test_a_cpu_call_leaves_triton_language_as_it_found_it():
    # what compiled kernels later in the process see: every function and method of triton.language
    # (the interpreter patches them while it runs)
    def state():
        owners = [m for n, m in sys.modules.items() if n.startswith("triton.language")]
        owners += [c for m in list(owners) for c in vars(m).values() if isinstance(c, type)]
        return {(id(o), name): value for o in owners for name, value in vars(o).items() if callable(value)}

    before = state()
    q, k, v, do = make_inputs("state", 1, 2, 2, 40, 40, 16, F32, "bthd")
    torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do)
    after = state()
    assert [key for key, value in before.items() if after.get(key) is not value] == []


@pytest.mark.slow
@pytest.mark.parametrize("interpret", ["unset", "1"])
def test_cpu_tensors_run_interpreted_and_cuda_tensors_compiled_in_one_process(interpret):
    # a fresh process; torch.compile imports triton first, as in a compiled training run. With
    # TRITON_INTERPRET unset the CPU call runs the interpreted twins and leaves triton.language's
    # compiled functions in place, so that a CUDA call after it (where there is a GPU) compiles.
    script = (
        "import torch, triton.language as tl\n"
        "torch.compile(lambda x: x + 1, backend='aot_eager')(torch.ones(2))\n"
        "from kernels.runtime.internals import JITFunction\n"
        "from kernels import flash_attention\n"
        "from kernels.reference.flash_ref import attention_reference\n"
        "q, k, v = torch.randn(3, 1, 2, 40, 16).unbind(0)\n"
        "ref, _ = attention_reference(q, k, v)\n"
        "errors = [(flash_attention(q, k, v).double() - ref).abs().max().item()]\n"
        "assert isinstance(tl.max, JITFunction) == ('TRITON_INTERPRET' not in __import__('os').environ)\n"
        "if torch.cuda.is_available():\n"
        "    out = flash_attention(q.cuda(), k.cuda(), v.cuda())\n"
        "    errors.append((out.double().cpu() - ref).abs().max().item())\n"
        "print(max(errors))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret == "1":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) < 1e-5


def _rows_past_2_31(T, H, D, dtype, device):
    """q, k, v and dO (1, H, T, D), each a view of one buffer whose rows are 2**26 elements apart,
    [q | k | v | dO] at the start of each: a fused projection stretched so that rows 32 on lie
    2**31 elements or more past their head's start. Only those rows are written: the rest of the
    buffer (~2.6e9 elements) is never touched, so it costs address space, not memory."""
    row = 2**26
    buffer = torch.empty((T - 1) * row + 4 * H * D, dtype=dtype, device=device)
    views = [buffer.as_strided((1, H, T, D), (buffer.numel(), D, row, 1), i * H * D) for i in range(4)]
    gen = torch.Generator().manual_seed(T)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    return views


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("loads", ["as chosen", "pointers"])
def test_offsets_past_2_31_within_one_head(device, loads, request):
    # a million-token sequence's fused qkv puts a head's last rows past 2**31 elements: the
    # kernels' offsets are int64, so they read and write those rows as they do any other (the
    # same bits as compact copies of the same values); int32 offsets would wrap
    if device == "cpu" and loads == "pointers":
        pytest.skip("the CPU runs the pointer path either way")
    if loads == "pointers":
        request.getfixturevalue("pointer_loads")
    dtype = F16 if device == "cpu" else BF16
    q, k, v, do = _rows_past_2_31(40, 2, 16, dtype, device)
    assert (q.shape[2] - 1) * q.stride(2) >= 2**31
    compact = [t.contiguous() for t in (q, k, v, do)]
    o, lse = flash_attn_forward(q, k, v)
    o_ref, lse_ref = flash_attn_forward(*compact[:3])
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    grads = flash_attn_backward(do, q, k, v, o, lse)
    for got, want in zip(grads, flash_attn_backward(compact[3], *compact[:3], o_ref, lse_ref), strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.gpu
def test_different_devices_raise():
    x = _tensor(1, 2, 8, 16)
    with pytest.raises(ValueError, match="must be on one device"):
        flash_attention(x.cuda(), x, x.cuda())


def test_torch_compile_fullgraph():
    # the model's call: q, k, v are transposed slices of one (B, T, 3, H, D) projection
    B, T, H, D = 2, 40, 2, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3, H, D, generator=gen, requires_grad=True)

    def attend(qkv):
        q, k, v = qkv.unbind(2)
        o = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return o.transpose(1, 2).reshape(B, T, H * D).square().sum()

    eager = attend(qkv)
    (grad_eager,) = torch.autograd.grad(eager, qkv)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(qkv)
    (grad,) = torch.autograd.grad(out, qkv)
    assert torch.equal(out, eager) and torch.equal(grad, grad_eager)

    # one tensor as q, k and v (Dynamo cannot trace a hand-written autograd.Function with that)
    x = qkv.detach()[:, :, 0].transpose(1, 2).requires_grad_()
    self_attend = torch.compile(lambda x: flash_attention(x, x, x).sum(), backend="aot_eager", fullgraph=True)
    (grad,) = torch.autograd.grad(self_attend(x), x)
    (grad_eager,) = torch.autograd.grad(flash_attention(x, x, x).sum(), x)
    assert torch.equal(grad, grad_eager)


def test_autocast_casts_inputs():
    q, k, v, do = make_inputs("autocast", 1, 2, 2, 24, 24, 16, F32, "bthd")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flash_attention(q, k, v, causal=True)
    assert o.dtype == torch.bfloat16
    grads = torch.autograd.grad(o, (q, k, v), do.to(torch.bfloat16))
    assert all(g.dtype == F32 for g in grads)  # autograd casts back to the fp32 leaves
    bf16 = [t.detach().to(torch.bfloat16) for t in (q, k, v)]
    assert torch.equal(o, flash_attention(*bf16, causal=True))


# --------------------------------------------------------------------------------------------
# GPU: real shapes, bf16 and fp16

BF16 = torch.bfloat16
# (dtype, B, H, H_kv, T, S, D, causal, layout); the float64 reference materialises (B, H, T, S)
# float64 scores and probabilities with their gradients: a few GB at T = S = 8192 with B * H = 2
GPU_CASES = [
    (BF16, 1, 2, 2, 8192, 8192, 64, True, "packed"),
    (F16, 1, 2, 1, 8192, 8192, 128, True, "bthd"),
    (BF16, 1, 2, 2, 4096, 4096, 256, True, "bthd"),
    (F16, 1, 2, 2, 4096, 4096, 256, False, "contiguous"),
    (BF16, 2, 4, 2, 2048, 2048, 96, True, "packed"),
    (F16, 2, 4, 4, 1000, 1000, 80, False, "bthd"),
    (BF16, 2, 8, 2, 1024, 1024, 128, False, "contiguous"),
    (F16, 1, 4, 2, 777, 1500, 64, True, "bthd"),
    (BF16, 1, 4, 4, 1500, 777, 128, True, "bthd"),
    (BF16, 4, 8, 1, 1, 4096, 64, True, "contiguous"),
    (F32, 1, 4, 2, 1024, 1024, 64, True, "bthd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(*c)) for c in GPU_CASES])
def test_gpu_matches_float64_reference(case):
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    check_against_float64(case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(BF16, 2, 4, 2, 1000, 1000, 64, True, "packed", True),
                                  (F16, 1, 3, 3, 777, 777, 20, True, "bthd", False),
                                  (BF16, 1, 4, 2, 1500, 777, 128, True, "bthd", True)],
                         ids=lambda c: case_id(*c[:-1]) + ("-pointers" if c[-1] else ""))
def test_gpu_pointer_path_matches_float64_reference(case, request):
    # the GPU runs the pointer loads where TMA cannot read the inputs (here 3 heads of D = 20 in
    # fp16: a 120-byte row stride), and on GPUs before sm_90 (here forced: pointer_loads)
    *case, forced = case
    if forced:
        request.getfixturevalue("pointer_loads")
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    q, k, v, _ = make_inputs(case_id(*case), B, H, H_kv, T, S, D, dtype, layout, device="cuda")
    if not forced:
        assert not inputs.uses_tma(q, k, v)
    check_against_float64("pointers-" + case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90+")
def test_gpu_tma_where_it_can_read_the_inputs_and_the_same_bits_as_the_pointers():

    for layout in ("contiguous", "bthd", "packed"):
        q, k, v, do = make_inputs(f"tma-{layout}", 2, 4, 2, 300, 300, 64, BF16, layout, device="cuda")
        assert inputs.uses_tma(q, k, v, do), layout
    # a gradient expanded along T (the backward of a sum over positions) has row stride 0: pointers
    do = torch.randn(2, 1, 4, 64, device="cuda", dtype=BF16).expand(2, 300, 4, 64).transpose(1, 2)
    assert not inputs.uses_tma(q, k, v, do)
    o = flash_attention(q, k, v)
    # FLASH_ATTENTION_AUTOTUNE=0: both paths run the same block configs, so the same arithmetic
    for expanded, copied in zip(torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                                torch.autograd.grad(o, (q, k, v), do.contiguous()), strict=True):
        assert torch.equal(expanded, copied)


@pytest.mark.gpu
@pytest.mark.parametrize("D, dtype", [(64, BF16), (128, F16)])
def test_gpu_document_mask_matches_float64_reference(D, dtype):
    lengths = [[1, 700, 1300, 64, 33, 1950], [4048]]  # 4048 tokens, tiles of 64 and 128 rows
    check_against_float64(f"gpu-docs-{D}", 2, 4, 2, 4048, 4048, D, True, dtype, "packed", "cuda",
                           doc_ids=doc_ids_of(lengths, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("D, dtype, window, docs", [(64, BF16, 700, False), (128, F16, 1024, False),
                                                     (96, BF16, 1, False), (64, BF16, 300, True)])
def test_gpu_window_matches_float64_reference(D, dtype, window, docs):
    lengths = [[1, 700, 1300, 64, 33, 1950], [4048]]
    doc_ids = doc_ids_of(lengths, "cuda") if docs else None
    check_against_float64(f"gpu-window-{D}-{window}-{docs}", 2, 4, 2, 4048, 4048, D, True, dtype, "packed", "cuda",
                           doc_ids=doc_ids, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 256])
def test_gpu_every_tuning_config_is_correct(D):
    # autotuning may pick any config that fits: each one must be right
    for launcher in LAUNCHERS.values():
        for config in launcher.candidates({"HEAD_DIM": D}, BF16.itemsize,
                                          chips.chip(torch.cuda.current_device())):
            _check_config(launcher, config, D, BF16, "cuda")


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    q, k, v, do = make_inputs("gpu-determinism", 2, 8, 2, 2048, 2048, 128, BF16, "packed", device="cuda")

    def grads():
        o = flash_attention(q, k, v, causal=True)
        return torch.autograd.grad(o, (q, k, v), do)

    for first, second in zip(grads(), grads(), strict=True):
        assert torch.equal(first, second)


@pytest.mark.gpu
def test_gpu_autocast_and_inductor():
    # fp32 q, k, v under bf16 autocast, eager and compiled by inductor with fullgraph=True
    q, k, v, do = make_inputs("gpu-compile", 2, 4, 2, 512, 512, 64, F32, "bthd", device="cuda")

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    with torch.autocast("cuda", dtype=BF16):
        out_eager, out = attend(q, k, v), compiled(q, k, v)
    assert out.dtype == BF16 and torch.equal(out, out_eager)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), do.to(BF16))
    grads = torch.autograd.grad(out, (q, k, v), do.to(BF16))
    for g, g_eager in zip(grads, grads_eager, strict=True):
        assert g.dtype == F32 and torch.equal(g, g_eager)
