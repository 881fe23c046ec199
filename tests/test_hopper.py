"""The Hopper kernels (kernels/flash_attn_hopper.py): compiled for sm_90 on every machine, checked
against float64 where an sm_90 GPU is present (Gluon has no interpreter)."""

import os
import re
import subprocess
import sys

import pytest
import torch
import triton

import kernels.flash_attn as fa
from kernels import flash_attention
from tests.helpers import REPO
from tests.test_flash_attn import BF16, F16, _case_id, _check_against_float64, _make_inputs

GLUON = triton.__version__.startswith(fa.GLUON_TRITON)
# where the installed triton is another release, `make test` puts triton 3.6 here for the compile check
GLUON_TRITON_DIR = REPO / ".venv" / "gluon-triton"
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not SM90, reason="the Hopper kernel runs on sm_90 GPUs only")


@pytest.fixture
def gluon(monkeypatch):
    """FLASH_ATTENTION_BACKEND=gluon: the Hopper kernels run both ways, or the call raises."""
    monkeypatch.setenv(fa.BACKEND_VARIABLE, "gluon")


# unset: the faster kernel per direction, head dim and length; gluon: both directions in Gluon
BACKENDS = [pytest.param("", id="auto"), pytest.param("gluon", id="gluon")]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(fa.BACKEND_VARIABLE, request.param)
    return request.param


@pytest.mark.skipif(not GLUON and not (GLUON_TRITON_DIR / "triton").is_dir(),
                    reason=f"the kernel is written in triton {fa.GLUON_TRITON}x's Gluon: `make test` installs it")
def test_compiles_for_sm90_without_a_gpu(tmp_path):
    # a fresh process: the stand-in driver replaces Triton's for the process, and Gluon must not
    # see TRITON_INTERPRET (it has no interpreter)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if not GLUON:
        env["PYTHONPATH"] = os.pathsep.join([str(GLUON_TRITON_DIR), str(REPO)])
    out = subprocess.run([sys.executable, "-m", "kernels.sm90", "--sass", "--out", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8, out.stdout  # forward and backward, D 64 and 128, causal and not
    for line in lines:
        assert int(re.search(r"(\d+) HGMMA", line)[1]) > 0, line  # the matmuls run on Hopper's wgmma


def test_backend_variable_is_checked(monkeypatch):
    q = k = v = torch.randn(1, 1, 4, 16)
    monkeypatch.setenv(fa.BACKEND_VARIABLE, "cudnn")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=cudnn: use triton or gluon"):
        flash_attention(q.requires_grad_(), k, v).sum().backward()
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=cudnn: use triton or gluon"):
        fa.backends(16, torch.float32, torch.device("cpu"), 1024)
    monkeypatch.setenv(fa.BACKEND_VARIABLE, "gluon")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=gluon: .*CUDA GPUs only"):
        flash_attention(q, k, v).sum().backward()


def test_backends_say_which_kernels_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(fa.BACKEND_VARIABLE, raising=False)
    assert fa.backends(64, BF16, cpu, 4096) == {"forward": "triton", "backward": "triton"}
    assert "CUDA GPUs only" in fa.gluon_missing(64, BF16, cpu)
    if SM90 and GLUON:
        gpu = torch.device("cuda")
        # unset: from GLUON_MIN_SEQ queries on, the Gluon forward where it covers the inputs, the
        # Gluon backward at head dim 128 and the Triton backward at 64, the faster of each;
        # the Triton kernels below it, where host time decides
        long, short = fa.GLUON_MIN_SEQ, fa.GLUON_MIN_SEQ - 1
        assert fa.backends(128, BF16, gpu, long) == {"forward": "gluon", "backward": "gluon"}
        assert fa.backends(64, BF16, gpu, long) == {"forward": "gluon", "backward": "triton"}
        assert fa.backends(128, BF16, gpu, short) == {"forward": "triton", "backward": "triton"}
        assert fa.backends(80, BF16, gpu, long) == {"forward": "triton", "backward": "triton"}
        assert fa.backends(64, F16, gpu, long, documents=True) == {"forward": "triton", "backward": "triton"}
        monkeypatch.setenv(fa.BACKEND_VARIABLE, "triton")
        assert fa.backends(128, BF16, gpu, long) == {"forward": "triton", "backward": "triton"}
        monkeypatch.setenv(fa.BACKEND_VARIABLE, "gluon")
        assert fa.backends(128, BF16, gpu, short) == {"forward": "gluon", "backward": "gluon"}
        with pytest.raises(ValueError, match="head_dim 64 and 128, not 80"):
            fa.backends(80, BF16, gpu, long)
        with pytest.raises(ValueError, match="packed documents run on the Triton kernels"):
            fa.backends(64, F16, gpu, long, documents=True)


# (dtype, B, H, H_kv, T, S, D, causal, layout): both head dims and dtypes, causal and not, odd T,
# T < S and T > S, GQA and MQA, every layout, a single query row
GPU_CASES = [
    (BF16, 1, 2, 2, 8192, 8192, 64, True, "packed"),
    (F16, 1, 2, 1, 4096, 4096, 128, True, "bthd"),
    (BF16, 2, 4, 2, 1000, 1000, 128, False, "contiguous"),
    (F16, 2, 4, 4, 333, 333, 64, False, "bthd"),
    (F16, 1, 4, 2, 777, 1500, 64, True, "bthd"),
    (BF16, 1, 4, 4, 1500, 777, 128, True, "bthd"),
    (BF16, 2, 8, 1, 2048, 2048, 128, True, "packed"),
    (BF16, 4, 8, 1, 1, 4096, 64, True, "contiguous"),
    (BF16, 1, 2, 2, 100, 37, 64, False, "bthd"),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(*c)) for c in GPU_CASES])
def test_gluon_matches_float64_reference(case, backend):
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    _check_against_float64(f"gluon{backend}-" + _case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout,
                           device="cuda")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_forward_never_reads_keys_past_its_rows(D, monkeypatch):
    monkeypatch.delenv(fa.BACKEND_VARIABLE, raising=False)
    # causal: the program of the first 192 rows (at most: 3 warpgroups of 64) loads no key block
    # past key 255; NaN there must not reach its rows, whose output stays bit for bit the same
    q, k, v, _ = _make_inputs(f"gluon-skip-{D}", 1, 4, 2, 4096, 4096, D, BF16, "bthd", "cuda")
    clean = fa.flash_attn_forward(q, k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 256:] = float("nan")
    v2[:, :, 256:] = float("nan")
    poisoned = fa.flash_attn_forward(q, k2, v2)
    assert fa.backends(D, BF16, q.device, 4096)["forward"] == "gluon"
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a[:, :, :192], b[:, :, :192])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_backward_is_bit_identical_over_100_runs(causal, gluon):
    # the dQ shares are added in a fixed order; unordered atomics would differ within a few runs
    q, k, v, do = _make_inputs(f"gluon-determinism-{causal}", 2, 8, 2, 2048, 2048, 128, BF16, "packed", "cuda")
    o = flash_attention(q, k, v, causal=causal)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    for _ in range(100):
        for a, b in zip(first, torch.autograd.grad(o, (q, k, v), do, retain_graph=True), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@sm90
def test_gluon_refuses_what_it_cannot_run(gluon):
    q, k, v, do = _make_inputs("gluon-d80", 1, 2, 2, 256, 256, 80, BF16, "bthd", "cuda")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=gluon: the Hopper forward .*head_dim 64 and 128, not 80"):
        torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do)


@pytest.mark.gpu
@sm90
def test_gluon_under_inductor_fullgraph(backend):
    q, k, v, do = _make_inputs(f"gluon{backend}-compile", 2, 4, 2, 1024, 1024, 128, BF16, "packed", "cuda")

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    out_eager, out = attend(q, k, v), compiled(q, k, v)
    assert torch.equal(out, out_eager)
    for g, g_eager in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(out_eager, (q, k, v), do),
                          strict=True):
        assert torch.equal(g, g_eager)


@pytest.mark.gpu
@sm90
def test_gluon_later_launches_use_the_new_tensors(gluon):
    # the first call per layout goes through Triton's front door; later calls launch the compiled
    # kernels with descriptors rebuilt from the new tensors' addresses
    hopper = fa._hopper()
    a, b = (_make_inputs(f"gluon-rebind-{name}", 1, 4, 2, 1000, 1000, 128, BF16, "bthd", "cuda") for name in "ab")

    def run(q, k, v, do):
        o = flash_attention(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    hopper._FWD_BOUND.clear()
    hopper._BWD_BOUND.clear()
    first_b = run(*b)
    later_a, later_b = run(*a), run(*b)
    hopper._FWD_BOUND.clear()
    hopper._BWD_BOUND.clear()
    first_a = run(*a)
    for first, later in ((first_a, later_a), (first_b, later_b)):
        for x, y in zip(first, later, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(first_a[0], first_b[0])
