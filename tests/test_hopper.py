"""The Hopper kernels (kernels/hopper/): compiled for sm_90 on every machine, checked against
float64 where an sm_90 GPU is present (Gluon has no interpreter)."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.experimental.gluon
from triton.experimental.gluon import language as gl

from kernels import backends, flash_attention, flash_attn_backward, flash_attn_forward
from kernels.hopper import bwd_passes
from kernels.hopper import config as hopper
from kernels.runtime.internals import interpreted, interpreting
from kernels.runtime.launch import PREPARED
from tests.helpers import (REPO, assert_right_where_seen, case_id, check_against_float64, doc_ids_of, make_inputs,
                           poisoned)

BF16, F16 = torch.bfloat16, torch.float16

GLUON = triton.__version__.startswith(hopper.TRITON)
# where the installed triton is another release, `make test` puts triton 3.6 here for the compile check
GLUON_TRITON_DIR = REPO / ".venv" / "gluon-triton"
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not SM90, reason="the Hopper kernel runs on sm_90 GPUs only")


# auto: the faster kernels per direction, head dim and length (the Hopper ones from MIN_SEQ
# queries on); gluon: both directions in Gluon, or the call raises
@pytest.fixture(params=["auto", "gluon"])
def backend(request):
    return request.param


def loop_spills(sass: str) -> tuple[int, list[str]]:
    """(how many loops issue wgmmas themselves, the local-memory instructions inside them) of a
    kernel's SASS: the smallest span from a label to a conditional branch back to it around each
    HGMMA. A spill there costs every key or query block. Outside, ptxas keeps a few values a
    persistent program needs once a tile (its tile count, a tile's strides) on the stack and
    reloads them as a tile starts or ends: L1 hits, once per tile."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", line))}
    loops = [(labels[m[1]], i) for i, line in enumerate(lines)
             if (m := re.search(r"@!?U?P\w* BRA `\((\.L_x_\d+)\)", line)) and labels.get(m[1], i) < i]
    inner = {min((loop for loop in loops if loop[0] <= i <= loop[1]), key=lambda loop: loop[1] - loop[0])
             for i, line in enumerate(lines) if "HGMMA" in line and any(lo <= i <= hi for lo, hi in loops)}
    spills = [lines[i] for lo, hi in inner for i in range(lo, hi + 1) if re.search(r"\b(LDL|STL)\b", lines[i])]
    return len(inner), spills


@pytest.mark.skipif(not GLUON and not (GLUON_TRITON_DIR / "triton").is_dir(),
                    reason=f"the kernel is written in triton {hopper.TRITON}x's Gluon: `make test` installs it")
def test_compiles_for_sm90_without_a_gpu(tmp_path):
    # a fresh process: the stand-in driver replaces Triton's for the process, and Gluon must not
    # see TRITON_INTERPRET (it has no interpreter)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if not GLUON:
        env["PYTHONPATH"] = os.pathsep.join([str(GLUON_TRITON_DIR), str(REPO)])
    out = subprocess.run([sys.executable, "scripts/sm90.py", "--sass", "--out", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    # forward and backward, D 64 and 128, full, causal and documents (the backward's causal kernel
    # at D = 128 goes longest first)
    assert len(lines) == 12, out.stdout
    for line in lines:
        assert int(re.search(r"(\d+) HGMMA", line)[1]) > 0, line  # the matmuls run on Hopper's wgmma
        assert int(re.search(r"(\d+) B shared", line)[1]) <= 232448, line  # an sm_90 block's most
        stack = int(re.search(r"(\d+) B stack", line)[1])
        sass = (tmp_path / f"{line.split(':')[0]}.sass").read_text()
        loops, spills = loop_spills(sass)
        # ptxas serializes every wgmma of a kernel it cannot pipeline (its C7512 and C7514 advisories,
        # which Triton drops unless TRITON_DUMP_PTXAS_LOG=1): a wait then follows each one
        assert 2 * sass.count("WARPGROUP.DEPBAR") < sass.count("HGMMA"), line
        assert loops, line  # every kernel's matmuls sit in a loop the rule can see
        # no register spills, but once a tile: the backward's without a mask keep up to 24 B, the
        # forward's with documents at D = 128 16 B
        limit = 32 if line.startswith("bwd") else 16 if line.startswith("fwd_d128_documents") else 8
        assert stack <= limit and not spills, line
    # where the forward overlaps, each step's softmax (a thread's 64 exp2s of a 64 x 128 block) sits
    # between the wait for its S, P V of the block before still in flight, and the wait for that
    # P V: ptxas had hoisted the second wait above the exp2s, which runs the two in turn again
    for D in [D for D, row in hopper.TABLE.items() if row.fwd_overlap]:
        forwards = sorted(tmp_path.glob(f"fwd_d{D}_*.sass"))
        assert len(forwards) == 3, forwards
        for sass in forwards:
            steps = re.split(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass.read_text())[1:]
            assert steps, sass.name
            assert min(step.split("WARPGROUP.DEPBAR")[0].count("MUFU.EX2") for step in steps) >= 64, sass.name


def test_compiling_refuses_a_head_dim_without_kernels_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "scripts/sm90.py", "--head-dims", "64,96", "--out",
                          str(tmp_path / "sass")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].endswith("--head-dims 64,96: the Hopper kernels have head dims 64, 128")
    assert not (tmp_path / "sass").exists()  # refused before anything is written


def test_backward_order_is_chosen_per_head_dim_and_mask():
    # longest first, in sections of 8 (batch, kv head) pairs, only where its row says and it measured
    # faster: plain causal, D = 128; shortest first (0) elsewhere
    assert hopper.bwd_section(128, True, False) == 8
    assert hopper.bwd_section(128, True, True) == 0  # documents, a window
    assert hopper.bwd_section(128, False, False) == 0
    assert hopper.bwd_section(64, True, False) == 0


def test_every_choice_of_the_kernels_is_a_row_of_the_table_not_the_environment():
    # no kernel file reads an environment variable but FLASH_ATTENTION_AUTOTUNE (how a config is
    # first chosen for a shape, kept per shape): a launch kept per signature cannot go stale
    for path in (REPO / "kernels").rglob("*.py"):
        text = path.read_text()
        assert set(re.findall(r'"(FLASH_ATTENTION_[A-Z0-9_]+)"', text)) <= {"FLASH_ATTENTION_AUTOTUNE"}, path
        assert "os.environ" not in text or path.name == "launch.py", path
    for D, row in hopper.TABLE.items():
        for tiles in (row.fwd, row.fwd_long):
            assert tiles.consumers * hopper.FWD_ROWS <= 192 and tiles.stages >= 2, (D, tiles)
        assert row.bwd.block_m in (64, 128), (D, row.bwd)


@pytest.mark.parametrize("T, D, block_m", [(300, 64, 128), (200, 128, 64), (64, 64, 64)])
def test_dq_pass_puts_the_slabs_back_in_row_order(T, D, block_m):
    """The backward's dQ pass (Triton's interpreter, on the CPU): each Q block's accumulator, in
    8-column slabs (D / 8, BLOCK_M, 8), comes back scaled, in row order, into dq laid out as
    kernels/api.py lays it out ((B, T, H, D) memory); the last block's padding rows, past T, are
    not written."""
    B, H, scale = 2, 3, 0.125
    blocks = triton.cdiv(T, block_m)
    slabs = torch.randn(B, H, blocks, D // 8, block_m, 8)
    memory = torch.full((B, T + 3, H, D), float("nan"))  # rows past T: what must stay unwritten
    dq = memory[:, :T].transpose(1, 2)
    grid, args = bwd_passes.dq_launch(slabs.view(-1, bwd_passes.LINE), dq, scale, block_m)
    with interpreting():
        interpreted(bwd_passes.dq_kernel)[grid](*args)
    want = slabs.permute(0, 1, 2, 4, 3, 5).reshape(B, H, blocks * block_m, D)[:, :, :T] * scale
    assert torch.equal(dq, want) and memory[:, T:].isnan().all()


@pytest.mark.parametrize("T, D, block_m", [(70, 64, 128), (130, 128, 64), (1, 64, 64)])
def test_lse_delta_pass_lays_out_both_rows_for_tma_and_zeroes_the_rest(T, D, block_m):
    """The backward's first pass (Triton's interpreter): per (batch, head), LSE * log2(e) and
    rowsum(dO * O) over rows padded to a multiple of 4, zero past T, from o and dO in the (B, T, H, D)
    memory the model makes; and every float of the buffers after aux (the dQ accumulator, the order
    counts: the tile counter, then the order counters) zeroed, whatever the allocation held before."""
    B, H = 2, 3
    o, do = (torch.randn(B, T, H, D).transpose(1, 2) for _ in range(2))
    lse = torch.randn(B, H, T)
    scratch, (aux, dq_acc, counts, zeroed) = bwd_passes.buffers(o, block_m, "cpu")
    scratch.fill_(float("nan"))
    grid, args = bwd_passes.lse_delta_launch(o, do, lse, aux, zeroed, block_m)
    with interpreting():
        interpreted(bwd_passes.lse_delta_kernel)[grid](*args)
    torch.testing.assert_close(aux[:, :, 0, :T], lse / math.log(2))
    torch.testing.assert_close(aux[:, :, 1, :T], (o * do).sum(-1))
    assert (aux[:, :, :, T:] == 0).all()
    assert aux.numel() + zeroed.numel() == scratch.numel() and (zeroed == 0).all()
    assert counts.numel() == 4 + B * H * triton.cdiv(T, block_m) and (counts == 0).all()
    assert counts.data_ptr() % 16 == 0 and counts[4:].data_ptr() % 16 == 0
    assert dq_acc.numel() == B * H * triton.cdiv(T, block_m) * block_m * D


def test_backend_is_checked():
    q = k = v = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="flash_attention: backend='cudnn': choose one of auto, triton, gluon"):
        flash_attention(q.requires_grad_(), k, v, backend="cudnn")
    with pytest.raises(ValueError, match="flash_attention: backend='cudnn': choose one of auto, triton, gluon"):
        backends.backends(16, torch.float32, torch.device("cpu"), 1024, "cudnn")
    with pytest.raises(ValueError, match="backend=gluon: .*CUDA GPUs only"):
        flash_attention(q, k, v, backend="gluon").sum().backward()


def test_backends_say_which_kernels_run():
    cpu = torch.device("cpu")
    assert backends.backends(64, BF16, cpu, 4096) == {"forward": "triton", "backward": "triton"}
    assert "CUDA GPUs only" in backends.unsupported(64, BF16, cpu, "gluon")
    if SM90 and GLUON:
        gpu = torch.device("cuda")
        # auto: from MIN_SEQ queries on, the Gluon kernels where they cover the inputs, the
        # faster; the Triton kernels below it, where host time decides
        long, short = hopper.MIN_SEQ, hopper.MIN_SEQ - 1
        assert backends.backends(128, BF16, gpu, long) == {"forward": "gluon", "backward": "gluon"}
        assert backends.backends(64, BF16, gpu, long) == {"forward": "gluon", "backward": "gluon"}
        assert backends.backends(128, BF16, gpu, short) == {"forward": "triton", "backward": "triton"}
        assert backends.backends(80, BF16, gpu, long) == {"forward": "triton", "backward": "triton"}
        assert backends.backends(128, BF16, gpu, long, "triton") == {"forward": "triton", "backward": "triton"}
        assert backends.backends(128, BF16, gpu, short, "gluon") == {"forward": "gluon", "backward": "gluon"}
        with pytest.raises(ValueError, match="head_dim 64 and 128, not 80"):
            backends.backends(80, BF16, gpu, long, "gluon")


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
@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(*c)) for c in GPU_CASES])
def test_gluon_matches_float64_reference(case, backend):
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    check_against_float64(f"gluon-{backend}-" + case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout,
                           device="cuda", backend=backend)


# (dtype, B, H, H_kv, D, layout, document lengths per batch row): one-token documents (many in a
# row), documents that start mid-tile or on a tile edge (the tiles have 64, 128 and 192 rows),
# one document over a whole row, GQA and MQA, every layout, T a multiple of no tile
GPU_DOC_CASES = [
    (BF16, 2, 4, 2, 64, "packed", [[1, 700, 1300, 64, 33, 1950], [4048]]),
    (F16, 2, 4, 2, 128, "bthd", [[1, 700, 1300, 64, 33, 1950], [4048]]),
    (BF16, 1, 8, 1, 128, "contiguous", [[127, 129, 1, 1, 2000, 191, 193, 1406]]),
    (F16, 1, 4, 4, 64, "bthd", [[1] * 200 + [384, 2115]]),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", GPU_DOC_CASES, ids=lambda c: f"{str(c[0])[6:]}-D{c[4]}-kv{c[3]}-{c[5]}")
def test_gluon_document_mask_matches_float64_reference(case, backend):
    dtype, B, H, H_kv, D, layout, lengths = case
    T = sum(lengths[0])
    check_against_float64(f"gluon-{backend}-docs-{lengths}", B, H, H_kv, T, T, D, True, dtype, layout, "cuda",
                           doc_ids=doc_ids_of(lengths, "cuda"), backend=backend)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_tiles_of_other_documents_are_skipped_not_masked(D):
    # NaN in one document: a tile of it that the other document's rows or keys only masked would
    # still multiply NaN into their sums (0 * NaN); a skipped tile is never loaded, so the other
    # document's results stay bit for bit those of clean inputs. The boundary, 1536, is an edge
    # of every tile (64, 128 and 192 rows).
    doc_ids = doc_ids_of([[1536, 1536]], "cuda")
    q, k, v, do = make_inputs(f"gluon-doc-skip-{D}", 1, 4, 2, 3072, 3072, D, BF16, "bthd", "cuda")

    def run(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(q, k, v, doc_ids=doc_ids, backend="gluon")
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    clean = run(q, k, v, do)
    # the forward and the dQ shares skip document 0's key tiles for document 1's rows
    (v_nan,) = poisoned(v, where=slice(0, 1536))
    o, dq, _, _ = run(q, k, v_nan, do)
    assert_right_where_seen((o, dq), clean[:2], slice(1536, None), atol=None)
    # the dK/dV of document 0's keys skip document 1's query tiles
    q_nan, do_nan = poisoned(q, do, where=slice(1536, None))
    _, _, dk, dv = run(q_nan, k, v, do_nan.detach())
    assert_right_where_seen((dk, dv), clean[2:], slice(0, 1536), atol=None)


# (dtype, B, H, H_kv, T, S, D, layout, window, document lengths or None): a window of 1024 keys
# (a multiple of every tile), one of 700 (of none), of one key, T < S, MQA, a window within documents
GPU_WINDOW_CASES = [
    (BF16, 2, 4, 2, 4100, 4100, 64, "packed", 1024, None),
    (F16, 1, 4, 1, 3000, 3000, 128, "bthd", 700, None),
    (BF16, 1, 8, 2, 2500, 2500, 128, "contiguous", 1, None),
    (BF16, 1, 4, 2, 2100, 3000, 64, "bthd", 513, None),
    (BF16, 2, 4, 2, 4048, 4048, 128, "packed", 300, [[1, 700, 1300, 64, 33, 1950], [4048]]),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", GPU_WINDOW_CASES, ids=lambda c: f"{str(c[0])[6:]}-T{c[4]}-S{c[5]}-D{c[6]}-W{c[8]}")
def test_gluon_window_matches_float64_reference(case, backend):
    dtype, B, H, H_kv, T, S, D, layout, window, lengths = case
    doc_ids = None if lengths is None else doc_ids_of(lengths, "cuda")
    check_against_float64(f"gluon-{backend}-window-{case}", B, H, H_kv, T, S, D, True, dtype, layout, "cuda",
                           doc_ids=doc_ids, window=window, backend=backend)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_tiles_outside_the_window_are_skipped_not_masked(D, backend):
    # W = 1024: queries from 2304 on (an edge of every tile: 64, 128, 192 rows) see keys from 1281
    # on, so no program of theirs loads a key below 1280; keys below 1024 are seen by queries up to
    # 2046, so no program of theirs loads a query from 2112 on. NaN there leaves the other side's
    # results bit for bit those of clean inputs.
    window = 1024
    q, k, v, do = make_inputs(f"gluon-window-skip-{D}", 1, 4, 2, 4096, 4096, D, BF16, "bthd", "cuda")

    def run(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(q, k, v, window=window, backend=backend)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    clean = run(q, k, v, do)
    k_nan, v_nan = k.detach().clone(), v.detach().clone()
    k_nan[:, :, :1024] = float("nan")
    v_nan[:, :, :1024] = float("nan")
    o, dq, _, _ = run(q, k_nan, v_nan, do)
    for got, want in ((o, clean[0]), (dq, clean[1])):
        assert torch.isfinite(got[:, :, 2304:]).all() and torch.equal(got[:, :, 2304:], want[:, :, 2304:])
    q_nan, do_nan = q.detach().clone(), do.clone()
    q_nan[:, :, 2304:] = float("nan")
    do_nan[:, :, 2304:] = float("nan")
    _, _, dk, dv = run(q_nan, k, v, do_nan)
    for got, want in ((dk, clean[2]), (dv, clean[3])):
        assert torch.isfinite(got[:, :, :1024]).all() and torch.equal(got[:, :, :1024], want[:, :, :1024])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_forward_never_reads_keys_past_its_rows(D):
    # causal: the program of the first 192 rows (at most: 3 warpgroups of 64) loads no key block
    # past key 255; NaN there must not reach its rows, whose output stays bit for bit the same
    q, k, v, _ = make_inputs(f"gluon-skip-{D}", 1, 4, 2, 4096, 4096, D, BF16, "bthd", "cuda")
    clean = flash_attn_forward(q, k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 256:] = float("nan")
    v2[:, :, 256:] = float("nan")
    poisoned = flash_attn_forward(q, k2, v2)
    assert backends.backends(D, BF16, q.device, 4096)["forward"] == "gluon"
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a[:, :, :192], b[:, :, :192])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("mask", ["causal", "full", "documents", "window"])
@pytest.mark.parametrize("D, T", [(64, 2048), (128, 2048), (128, 8192)], ids=["D64", "D128", "D128-long"])
def test_gluon_backward_is_bit_identical_over_100_runs(D, T, mask):
    # the dQ shares are added in a fixed order, either launch order (at D = 128, causal: longest
    # first); unordered atomics would differ within a few runs
    B = 2 if T == 2048 else 1
    q, k, v, do = make_inputs(f"gluon-determinism-{mask}-{D}-{T}", B, 1024 // D, 2, T, T, D, BF16, "packed", "cuda")
    lengths = [[300, 1, 900, 847], [2048]] if T == 2048 else [[300, 1, 900, 6991]]
    doc_ids = doc_ids_of(lengths, "cuda") if mask == "documents" else None
    o = flash_attention(q, k, v, causal=mask != "full", doc_ids=doc_ids, window=700 if mask == "window" else 0,
                        backend="gluon")
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    for _ in range(100):
        for a, b in zip(first, torch.autograd.grad(o, (q, k, v), do, retain_graph=True), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@sm90
def test_gluon_refuses_what_it_cannot_run():
    q, k, v, do = make_inputs("gluon-d80", 1, 2, 2, 256, 256, 80, BF16, "bthd", "cuda")
    with pytest.raises(ValueError, match="backend=gluon: the Hopper forward .*head_dim 64 and 128, not 80"):
        torch.autograd.grad(flash_attention(q, k, v, backend="gluon"), (q, k, v), do)


@pytest.mark.gpu
@sm90
def test_gluon_under_inductor_fullgraph(backend):
    q, k, v, do = make_inputs(f"gluon-{backend}-compile", 2, 4, 2, 1024, 1024, 128, BF16, "packed", "cuda")

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    out_eager, out = attend(q, k, v), compiled(q, k, v)
    assert torch.equal(out, out_eager)
    for g, g_eager in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(out_eager, (q, k, v), do),
                          strict=True):
        assert torch.equal(g, g_eager)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_later_launches_use_the_new_tensors(D, documents):
    # the first call per layout goes through Triton's front door; later calls launch the compiled
    # kernels with descriptors rebuilt from the new tensors' addresses (and the new documents')
    a, b = (make_inputs(f"gluon-rebind-{name}-{D}", 1, 4, 2, 1000, 1000, D, BF16, "bthd", "cuda") for name in "ab")
    doc_ids = doc_ids_of([[300, 1, 699]], "cuda") if documents else None

    def run(q, k, v, do):
        o = flash_attention(q, k, v, doc_ids=doc_ids, backend="gluon")
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    PREPARED.clear()
    first_b = run(*b)
    later_a, later_b = run(*a), run(*b)
    PREPARED.clear()
    first_a = run(*a)
    for first, later in ((first_a, later_a), (first_b, later_b)):
        for x, y in zip(first, later, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(first_a[0], first_b[0])


def _poisoned_grads(q, k, v, do, doc_ids, window, backend="gluon"):
    """o, lse, dq, dk, dv of one forward and backward whose outputs may get memory that held NaN
    just before (freed at once, the caching allocator may hand the blocks on): a tile a launch
    skipped would keep it. dq is scaled from a zeroed accumulator, so only its value shows a
    skipped tile; the CUDA graphs below fill every output with NaN before each replay."""
    poison = [torch.full_like(x, float("nan")) for x in (q, q, k, k)]
    poison.append(torch.full(q.shape[:3], float("nan"), device=q.device))
    del poison
    o, lse = flash_attn_forward(q, k, v, doc_ids=doc_ids, window=window, backend=backend)
    return (o, lse, *flash_attn_backward(do, q, k, v, o, lse, doc_ids=doc_ids, window=window, backend=backend))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_kernels_take_every_tile_once(D):
    # the forward's and the backward's programs take tiles from counters zeroed for each launch: a
    # tile taken twice would add into dQ twice, one never taken would leave NaN where the poison
    # was, and either would differ from the portable kernels (one program per tile, by launch).
    # More tiles than SMs (up to ~4 a program, so that the rings and the tile ring wrap), fewer,
    # documents (tiles of unequal length, some with no steps), a window, longest first (D = 128,
    # causal) in one section of pairs and in two (9 pairs); launches in a row, on a second stream,
    # and from two CUDA graphs replayed in reverse order, each with the first launch's bits
    docs = [1, 700, 1300, 64, 33, 1950]
    cases = [(4, 8, 2, 3000, None, 0), (1, 2, 2, 300, None, 0), (2, 4, 2, 4048, [docs, [4048]], 0),
             (4, 8, 4, 4048, [docs, [4048], docs[::-1], [2024, 2024]], 0), (1, 8, 8, 8192, None, 0),
             (1, 8, 8, 8192, [[3000, 5192]], 1024), (3, 6, 3, 2500, None, 0)]
    for B, H, H_kv, T, lengths, window in cases:
        q, k, v, do = make_inputs(f"gluon-persistent-{D}-{T}", B, H, H_kv, T, T, D, BF16, "packed", "cuda")
        doc_ids = doc_ids_of(lengths, "cuda") if lengths else None
        first = _poisoned_grads(q, k, v, do, doc_ids, window)
        portable = _poisoned_grads(q, k, v, do, doc_ids, window, backend="triton")
        for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), first, portable, strict=True):
            assert torch.isfinite(x).all(), name
            assert (x.float() - y.float()).norm() <= 0.02 * y.float().norm(), name  # rounding, not a tile
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    for x, y in zip(_poisoned_grads(q, k, v, do, doc_ids, window), first, strict=True):
                        assert torch.equal(x, y)
        torch.cuda.current_stream().wait_stream(side)
        graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
        for graph in graphs:
            with torch.cuda.graph(graph):
                outs.append(_poisoned_grads(q, k, v, do, doc_ids, window))
        for graph, out in zip(graphs[::-1], outs[::-1]):
            for x in out:
                x.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for x, y in zip(out, first, strict=True):
                assert torch.equal(x, y)


@triton.experimental.gluon.jit
def _poll(ptr, target, polls):
    """ptr[0] once it reaches target, or as it is after `polls` reads."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    value = gl.max(gl.load(ptr + lane * 0, volatile=True), 0)
    i = 0
    while (value < target) & (i < polls):
        value = gl.max(gl.load(ptr + lane * 0, volatile=True), 0)
        i += 1
    return value


@triton.experimental.gluon.jit
def _hold_sm(flag, arrived, released, polls):
    """Counts itself in `arrived`, then holds its SM until flag[0] is set or `polls` reads have
    passed; released[program]: 1 where the flag ended it."""
    # 128 KB of shared memory: no second program on the SM, nor a backward program (~226 KB)
    smem = gl.allocate_shared_memory(gl.int32, [32768], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    smem.slice(0, 32).store(lane * 0)  # the allocation is used, so it stays
    gl.atomic_add(arrived + lane * 0, lane * 0 + 1, mask=lane == 0)
    seen = _poll(flag, 1, polls) + gl.max(smem.slice(0, 32).load(lane.type.layout), 0)
    gl.store(released + gl.program_id(0) + lane * 0, lane * 0 + seen, mask=lane == 0)


@triton.experimental.gluon.jit
def _wait_for(count, target, seen, polls):
    """Returns once count[0] reaches target (or after `polls` reads); seen[0]: the count then."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(seen + lane * 0, lane * 0 + _poll(count, target, polls), mask=lane == 0)


def held_backward(q, k, v, do, o, lse, free_sms: int = 4) -> tuple[int, int, int, tuple]:
    """(holders, how many had started before the backward, how many its end released, its grads)
    of a backward run while another kernel holds every SM but free_sms, until a flag that this
    stream sets after the backward (or, failing that, its poll limit: ~10 s). The kernels are
    compiled first: the holders must not wait on the host."""
    holders = torch.cuda.get_device_properties(q.device).multi_processor_count - free_sms
    flag, arrived, seen, released = (torch.zeros(n, dtype=torch.int32, device=q.device) for n in (1, 1, 1, holders))
    polls = 50_000_000
    _hold_sm[(1,)](flag + 1, arrived.clone(), released.clone(), polls, num_warps=1)  # flag set: returns
    _wait_for[(1,)](arrived + holders, holders, seen, polls, num_warps=1)  # count reached: returns
    flash_attn_backward(do, q, k, v, o, lse, backend="gluon")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _hold_sm[(holders,)](flag, arrived, released, polls, num_warps=1)
    _wait_for[(1,)](arrived, holders, seen, polls, num_warps=1)  # every holder is on its SM
    grads = flash_attn_backward(do, q, k, v, o, lse, backend="gluon")
    flag.fill_(1)
    torch.cuda.synchronize()
    return holders, seen.item(), released.eq(1).sum().item(), grads


@pytest.mark.gpu
@sm90
def test_backward_finishes_while_another_kernel_holds_most_sms():
    # dQ's fixed order makes a backward tile wait on the tiles before it, so those must be tiles
    # that running programs hold, whatever else runs: a program takes every tile from the counter
    # once it runs. With every SM but 4 held by another kernel until this backward is done, it ends
    # on the 4, and the flag set after it releases the holders, not their poll limit
    q, k, v, do = make_inputs("gluon-held-sms", 2, 8, 8, 4096, 4096, 128, BF16, "packed", "cuda")
    o, lse = flash_attn_forward(q, k, v, backend="gluon")
    expected = flash_attn_backward(do, q, k, v, o, lse, backend="gluon")
    holders, started, released, grads = held_backward(q, k, v, do, o, lse)
    assert started == holders, f"{started} of {holders} holders had started before the backward"
    assert released == holders, f"{holders - released} of {holders} holders stopped by their poll limit"
    for x, y in zip(grads, expected, strict=True):
        assert torch.equal(x, y)
