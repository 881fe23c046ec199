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
from kernels.runtime.interpreter import interpreted, interpreting
from tests.helpers import REPO
from tests.test_flash_attn import BF16, F16, _case_id, _check_against_float64, _doc_ids, _make_inputs

GLUON = triton.__version__.startswith(hopper.TRITON)
# where the installed triton is another release, `make test` puts triton 3.6 here for the compile check
GLUON_TRITON_DIR = REPO / ".venv" / "gluon-triton"
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not SM90, reason="the Hopper kernel runs on sm_90 GPUs only")


@pytest.fixture
def gluon(monkeypatch):
    """FLASH_ATTENTION_BACKEND=gluon: the Hopper kernels run both ways, or the call raises."""
    monkeypatch.setenv(backends.BACKEND_VARIABLE, "gluon")


# unset: the faster kernel per direction, head dim and length; gluon: both directions in Gluon
BACKENDS = [pytest.param("", id="auto"), pytest.param("gluon", id="gluon")]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(backends.BACKEND_VARIABLE, request.param)
    return request.param


# the schedule variants (kernels/hopper/config.py), each the value its variable's default is not
# (the forward's ring one slot shallower; its overlap is the default at FWD_OVERLAP_HEAD_DIMS, so
# there its variant is 0, as are its consumers' turns at FWD_TURNS_HEAD_DIMS (none) and its exp2s
# on the FMA pipe at FWD_EXP2_FMA_HEAD_DIMS); the backward
# has other tiles only at BWD_BY_ROWS' head dims: `variant`;
# its longest-first order is the default only from BWD_LONGEST_FIRST_FROM keys, more than compiled
# or tested here)
VARIANTS = {hopper.FWD_ORDER_VARIABLE: "heads", hopper.FWD_OVERLAP_VARIABLE: "1", hopper.FWD_STAGES_VARIABLE: "2",
            hopper.FWD_PERSISTENT_VARIABLE: "0", hopper.BWD_BY_KEYS_VARIABLE: "0",
            hopper.BWD_ORDER_VARIABLE: "longest", hopper.BWD_PERSISTENT_VARIABLE: "0",
            hopper.FWD_TURNS_VARIABLE: "1", hopper.FWD_EXP2_FMA_VARIABLE: "1"}


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


def variant(variable: str, head_dim: int) -> str | None:
    """The variable's value other than the default at this head dim; None where it has none."""
    if variable == hopper.FWD_OVERLAP_VARIABLE and head_dim in hopper.FWD_OVERLAP_HEAD_DIMS:
        return "0"
    if variable == hopper.FWD_TURNS_VARIABLE and head_dim in hopper.FWD_TURNS_HEAD_DIMS:
        return "0"
    if variable == hopper.FWD_EXP2_FMA_VARIABLE and head_dim in hopper.FWD_EXP2_FMA_HEAD_DIMS:
        return "0"
    if variable == hopper.BWD_BY_KEYS_VARIABLE and head_dim not in hopper.BWD_BY_ROWS:
        return None
    return VARIANTS[variable]


# compiled beside the defaults and VARIANTS: the backward persistent and longest first, its
# default at D = 128 from BWD_LONGEST_FIRST_FROM keys (VARIANTS pairs longest first with a
# program per tile), and the forward without its overlap
LONGEST_PERSISTENT = {hopper.FWD_OVERLAP_VARIABLE: "0", hopper.BWD_ORDER_VARIABLE: "longest"}


@pytest.mark.skipif(not GLUON and not (GLUON_TRITON_DIR / "triton").is_dir(),
                    reason=f"the kernel is written in triton {hopper.TRITON}x's Gluon: `make test` installs it")
@pytest.mark.parametrize("variants", [{}, VARIANTS, LONGEST_PERSISTENT],
                         ids=["defaults", "variants", "no-forward-overlap-longest-first"])
def test_compiles_for_sm90_without_a_gpu(variants, tmp_path):
    # a fresh process: the stand-in driver replaces Triton's for the process, and Gluon must not
    # see TRITON_INTERPRET (it has no interpreter)
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", *VARIANTS)}
    if not GLUON:
        env["PYTHONPATH"] = os.pathsep.join([str(GLUON_TRITON_DIR), str(REPO)])
    stdout = ""
    for D in hopper.HEAD_DIMS:  # one process per head dim: a variant a head dim lacks is left unset there
        chosen = {key: value for key, value in variants.items() if variant(key, D) is not None}
        out = subprocess.run([sys.executable, "-m", "kernels.runtime.sm90", "--sass", "--out", str(tmp_path),
                              "--head-dims", str(D)], cwd=REPO, env={**env, **chosen}, capture_output=True,
                             text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        stdout += out.stdout
    lines = stdout.strip().splitlines()
    assert len(lines) == 12, stdout  # forward and backward, D 64 and 128, full, causal and documents
    overlap = variants.get(hopper.FWD_OVERLAP_VARIABLE)
    for line in lines:
        assert int(re.search(r"(\d+) HGMMA", line)[1]) > 0, line  # the matmuls run on Hopper's wgmma
        assert int(re.search(r"(\d+) B shared", line)[1]) <= 232448, line  # an sm_90 block's most
        stack = int(re.search(r"(\d+) B stack", line)[1])
        loops, spills = loop_spills((tmp_path / f"{line.split(':')[0]}.sass").read_text())
        assert loops, line  # every kernel's matmuls sit in a loop the rule can see
        if overlap == "1" and line.startswith("fwd_d64_documents"):
            assert stack <= 32, line  # D 64's overlap, not adopted there, spills 16-32 B in the tile loop
        elif variants.get(hopper.BWD_ORDER_VARIABLE) == "longest" and line.startswith("bwd_d128_documents"):
            # longest first, never the default with documents, reloads one value a step (two with
            # a program per tile)
            assert stack <= 32 and len(spills) <= 2, line
        else:  # no register spills, but once a tile: the backward's without a mask keep up to 24 B,
            # the forward's with documents at D = 128 16 B (8 before perf-notes v30's mask)
            limit = 32 if line.startswith("bwd") else 16 if line.startswith("fwd_d128_documents") else 8
            assert stack <= limit and not spills, line
    # where the forward overlaps (every head dim with the variant's 1), each step's softmax (a
    # thread's 64 exp2s of a 64 x 128 block) sits between the wait for its S, P V of the block
    # before still in flight, and the wait for that P V: ptxas had hoisted the second wait above
    # the exp2s, which runs the two in turn again (on the exp2 unit: 64 and alpha's 2; with
    # FWD_EXP2_FMA, mask-free steps move a share of the 64, known at compile time, not both paths)
    dims = {"1": hopper.HEAD_DIMS, "0": ()}.get(overlap, hopper.FWD_OVERLAP_HEAD_DIMS)
    exp2_fma = variants.get(hopper.FWD_EXP2_FMA_VARIABLE)
    for D in dims:
        on_fma = (exp2_fma == "1") if exp2_fma else (D in hopper.FWD_EXP2_FMA_HEAD_DIMS)
        moved = 64 // hopper.FWD_EXP2_FMA_EVERY if on_fma else 0
        forwards = sorted(tmp_path.glob(f"fwd_d{D}_*.sass"))
        assert len(forwards) == 3, forwards
        for sass in forwards:
            steps = re.split(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass.read_text())[1:]
            assert steps, sass.name
            exp2s = [step.split("WARPGROUP.DEPBAR")[0].count("MUFU.EX2") for step in steps]
            assert min(exp2s) >= 64 - moved, sass.name
            if on_fma:  # the mask-free steps moved their share
                assert min(exp2s) <= 66 - moved, (sass.name, exp2s)


def test_compiling_refuses_a_head_dim_without_kernels_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kernels.runtime.sm90", "--head-dims", "64,96", "--out",
                          str(tmp_path / "sass")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].endswith("--head-dims 64,96: the Hopper kernels have head dims 64, 128")
    assert not (tmp_path / "sass").exists()  # refused before anything is written


def test_forward_ring_depth_is_checked_against_shared_memory(monkeypatch):
    monkeypatch.setenv(hopper.FWD_STAGES_VARIABLE, "4")
    assert hopper.fwd_tiles(64, 4096).stages == 4
    with pytest.raises(ValueError, match="FLASH_ATTENTION_FWD_STAGES=4: at head dim 128 the ring holds at most 3"):
        hopper.fwd_tiles(128, 4096)
    monkeypatch.setenv(hopper.FWD_STAGES_VARIABLE, "5")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_FWD_STAGES=5: use 2 or 3 or 4"):
        hopper.fwd_tiles(64, 4096)


def test_backward_tiles_by_rows_are_chosen_or_refused_per_head_dim(monkeypatch):
    # by keys by default at every head dim; by rows where there are tiles by rows
    assert not any(tiles.by_rows for tiles in hopper.BWD_TILES.values())
    assert all(tiles.by_rows for tiles in hopper.BWD_BY_ROWS.values())
    for choice, by_rows_64 in (("", False), ("1", False), ("0", True)):
        monkeypatch.setenv(hopper.BWD_BY_KEYS_VARIABLE, choice)
        assert hopper.bwd_tiles(64).by_rows == by_rows_64
        assert hopper.bwd_tiles(64).block_m == 128  # both ways round, 128 queries a step
        if choice != "0":
            assert hopper.bwd_tiles(128) == hopper.BWD_TILES[128]
    monkeypatch.setenv(hopper.BWD_BY_KEYS_VARIABLE, "0")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BWD_BY_KEYS=0: at head dim 128 the backward is held by "
                                         "keys only: use 1 or leave it unset"):
        hopper.bwd_tiles(128)
    monkeypatch.setenv(hopper.BWD_BY_KEYS_VARIABLE, "2")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BWD_BY_KEYS=2: use 0 or 1"):
        hopper.bwd_tiles(64)


def test_backward_order_is_chosen_per_head_dim_mask_and_keys(monkeypatch):
    # longest first by default only where it measured faster: plain causal, D = 128, from 8192 keys
    monkeypatch.delenv(hopper.BWD_ORDER_VARIABLE, raising=False)
    assert hopper.bwd_longest_first(128, True, False, 8192) and hopper.bwd_longest_first(128, True, False, 2 ** 24)
    assert not hopper.bwd_longest_first(128, True, False, 8191)
    assert not hopper.bwd_longest_first(128, True, True, 8192)  # documents, a window
    assert not hopper.bwd_longest_first(128, False, False, 8192)
    assert not hopper.bwd_longest_first(64, True, False, 65536)
    monkeypatch.setenv(hopper.BWD_ORDER_VARIABLE, "longest")
    assert hopper.bwd_longest_first(64, False, True, 100)
    monkeypatch.setenv(hopper.BWD_ORDER_VARIABLE, "shortest")
    assert not hopper.bwd_longest_first(128, True, False, 16384)
    monkeypatch.setenv(hopper.BWD_ORDER_VARIABLE, "lpt")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BWD_ORDER=lpt: use shortest or longest"):
        hopper.bwd_longest_first(128, True, False, 16384)


@pytest.mark.parametrize("variable, chosen, default", [
    (hopper.FWD_PERSISTENT_VARIABLE, hopper.fwd_persistent, hopper.FWD_PERSISTENT),
    (hopper.BWD_PERSISTENT_VARIABLE, hopper.bwd_persistent, hopper.BWD_PERSISTENT)], ids=["forward", "backward"])
def test_persistent_kernels_are_chosen_by_their_variables(variable, chosen, default, monkeypatch):
    monkeypatch.delenv(variable, raising=False)
    assert chosen() == default
    for value, persistent in (("0", False), ("1", True)):
        monkeypatch.setenv(variable, value)
        assert chosen() is persistent
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=f"{variable}=yes: use 0 or 1"):
        chosen()


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
    counters, the tile counter) zeroed, whatever the allocation held before."""
    B, H = 2, 3
    o, do = (torch.randn(B, T, H, D).transpose(1, 2) for _ in range(2))
    lse = torch.randn(B, H, T)
    scratch, (aux, dq_acc, sem, counter, zeroed) = bwd_passes.buffers(o, block_m, "cpu")
    scratch.fill_(float("nan"))
    grid, args = bwd_passes.lse_delta_launch(o, do, lse, aux, zeroed, block_m)
    with interpreting():
        interpreted(bwd_passes.lse_delta_kernel)[grid](*args)
    torch.testing.assert_close(aux[:, :, 0, :T], lse / math.log(2))
    torch.testing.assert_close(aux[:, :, 1, :T], (o * do).sum(-1))
    assert (aux[:, :, :, T:] == 0).all()
    assert aux.numel() + zeroed.numel() == scratch.numel() and (zeroed == 0).all()
    assert (sem == 0).all() and counter.item() == 0 and counter.data_ptr() % 16 == 0
    assert dq_acc.numel() == B * H * triton.cdiv(T, block_m) * block_m * D


def test_every_variable_that_chooses_kernels_is_in_the_calls_signature(monkeypatch):
    """A call's launches are kept per signature (kernels/api.py), and the signature reads the
    variables that choose kernels all at once (backends.variables): each must be in VARIABLES, or a
    change of it between calls would run the launch made before. Every FLASH_ATTENTION_* name the
    kernels read but FLASH_ATTENTION_AUTOTUNE (how a config is first chosen, kept per shape) is."""
    read = set()
    for path in (REPO / "kernels").rglob("*.py"):
        read |= set(re.findall(r'"(FLASH_ATTENTION_[A-Z0-9_]+)"', path.read_text()))
    assert read - {"FLASH_ATTENTION_AUTOTUNE"} == set(backends.VARIABLES)
    for name in backends.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert backends.variables() == (None,) * len(backends.VARIABLES)
    for name in backends.VARIABLES:
        before = backends.variables()
        monkeypatch.setenv(name, "1")
        after = backends.variables()
        assert [a != b for a, b in zip(after, before)] == [n == name for n in backends.VARIABLES]


def test_backend_variable_is_checked(monkeypatch):
    q = k = v = torch.randn(1, 1, 4, 16)
    monkeypatch.setenv(backends.BACKEND_VARIABLE, "cudnn")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=cudnn: use triton or gluon"):
        flash_attention(q.requires_grad_(), k, v).sum().backward()
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=cudnn: use triton or gluon"):
        backends.backends(16, torch.float32, torch.device("cpu"), 1024)
    monkeypatch.setenv(backends.BACKEND_VARIABLE, "gluon")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_BACKEND=gluon: .*CUDA GPUs only"):
        flash_attention(q, k, v).sum().backward()
    monkeypatch.delenv(backends.BACKEND_VARIABLE)
    monkeypatch.setenv(backends.DETERMINISTIC_VARIABLE, "yes")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_DETERMINISTIC=yes: use 1 .* or 0"):
        backends.backends(16, torch.float32, torch.device("cpu"), 1024)


def test_backends_say_which_kernels_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(backends.BACKEND_VARIABLE, raising=False)
    assert backends.backends(64, BF16, cpu, 4096) == {"forward": "triton", "backward": "triton"}
    assert "CUDA GPUs only" in backends.unsupported(64, BF16, cpu, "gluon")
    if SM90 and GLUON:
        gpu = torch.device("cuda")
        # unset: from MIN_SEQ queries on, the Gluon kernels where they cover the inputs, the
        # faster; the Triton kernels below it, where host time decides
        long, short = hopper.MIN_SEQ, hopper.MIN_SEQ - 1
        assert backends.backends(128, BF16, gpu, long) == {"forward": "gluon", "backward": "gluon"}
        assert backends.backends(64, BF16, gpu, long) == {"forward": "gluon", "backward": "gluon"}
        assert backends.backends(128, BF16, gpu, short) == {"forward": "triton", "backward": "triton"}
        assert backends.backends(80, BF16, gpu, long) == {"forward": "triton", "backward": "triton"}
        monkeypatch.setenv(backends.BACKEND_VARIABLE, "triton")
        assert backends.backends(128, BF16, gpu, long) == {"forward": "triton", "backward": "triton"}
        monkeypatch.setenv(backends.BACKEND_VARIABLE, "gluon")
        assert backends.backends(128, BF16, gpu, short) == {"forward": "gluon", "backward": "gluon"}
        with pytest.raises(ValueError, match="head_dim 64 and 128, not 80"):
            backends.backends(80, BF16, gpu, long)


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
    _check_against_float64(f"gluon{backend}-docs-{lengths}", B, H, H_kv, T, T, D, True, dtype, layout, "cuda",
                           doc_ids=_doc_ids(lengths, "cuda"))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_tiles_of_other_documents_are_skipped_not_masked(D, gluon):
    # NaN in one document: a tile of it that the other document's rows or keys only masked would
    # still multiply NaN into their sums (0 * NaN); a skipped tile is never loaded, so the other
    # document's results stay bit for bit those of clean inputs. The boundary, 1536, is an edge
    # of every tile (64, 128 and 192 rows).
    doc_ids = _doc_ids([[1536, 1536]], "cuda")
    q, k, v, do = _make_inputs(f"gluon-doc-skip-{D}", 1, 4, 2, 3072, 3072, D, BF16, "bthd", "cuda")

    def run(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(q, k, v, doc_ids=doc_ids)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    clean = run(q, k, v, do)
    # the forward and the dQ shares skip document 0's key tiles for document 1's rows
    v_nan = v.detach().clone()
    v_nan[:, :, :1536] = float("nan")
    o, dq, _, _ = run(q, k, v_nan, do)
    for got, want in ((o, clean[0]), (dq, clean[1])):
        assert torch.isfinite(got[:, :, 1536:]).all() and torch.equal(got[:, :, 1536:], want[:, :, 1536:])
    # the dK/dV of document 0's keys skip document 1's query tiles
    q_nan, do_nan = q.detach().clone(), do.clone()
    q_nan[:, :, 1536:] = float("nan")
    do_nan[:, :, 1536:] = float("nan")
    _, _, dk, dv = run(q_nan, k, v, do_nan)
    for got, want in ((dk, clean[2]), (dv, clean[3])):
        assert torch.isfinite(got[:, :, :1536]).all() and torch.equal(got[:, :, :1536], want[:, :, :1536])


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
    doc_ids = None if lengths is None else _doc_ids(lengths, "cuda")
    _check_against_float64(f"gluon{backend}-window-{case}", B, H, H_kv, T, S, D, True, dtype, layout, "cuda",
                           doc_ids=doc_ids, window=window)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_tiles_outside_the_window_are_skipped_not_masked(D, backend):
    # W = 1024: queries from 2304 on (an edge of every tile: 64, 128, 192 rows) see keys from 1281
    # on, so no program of theirs loads a key below 1280; keys below 1024 are seen by queries up to
    # 2046, so no program of theirs loads a query from 2112 on. NaN there leaves the other side's
    # results bit for bit those of clean inputs.
    window = 1024
    q, k, v, do = _make_inputs(f"gluon-window-skip-{D}", 1, 4, 2, 4096, 4096, D, BF16, "bthd", "cuda")

    def run(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(q, k, v, window=window)
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
def test_gluon_forward_never_reads_keys_past_its_rows(D, monkeypatch):
    monkeypatch.delenv(backends.BACKEND_VARIABLE, raising=False)
    # causal: the program of the first 192 rows (at most: 3 warpgroups of 64) loads no key block
    # past key 255; NaN there must not reach its rows, whose output stays bit for bit the same
    q, k, v, _ = _make_inputs(f"gluon-skip-{D}", 1, 4, 2, 4096, 4096, D, BF16, "bthd", "cuda")
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
@pytest.mark.parametrize("order", ["", "longest"], ids=["order-default", "longest-first"])
@pytest.mark.parametrize("mask", ["causal", "full", "documents", "window"])
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_backward_is_bit_identical_over_100_runs(D, mask, order, gluon, monkeypatch):
    # the dQ shares are added in a fixed order, either launch order; unordered atomics would differ
    # within a few runs
    monkeypatch.setenv(hopper.BWD_ORDER_VARIABLE, order)
    q, k, v, do = _make_inputs(f"gluon-determinism-{mask}-{D}", 2, 1024 // D, 2, 2048, 2048, D, BF16, "packed",
                               "cuda")
    doc_ids = _doc_ids([[300, 1, 900, 847], [2048]], "cuda") if mask == "documents" else None
    o = flash_attention(q, k, v, causal=mask != "full", doc_ids=doc_ids, window=700 if mask == "window" else 0)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    for _ in range(100):
        for a, b in zip(first, torch.autograd.grad(o, (q, k, v), do, retain_graph=True), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[3], GPU_CASES[5]], ids=lambda c: _case_id(*c))
def test_gluon_unordered_dq_matches_float64_reference(case, gluon, monkeypatch):
    # FLASH_ATTENTION_DETERMINISTIC=0: dQ's shares added as they come, not in turn
    monkeypatch.setenv(backends.DETERMINISTIC_VARIABLE, "0")
    dtype, B, H, H_kv, T, S, D, causal, layout = case
    _check_against_float64("gluon-unordered-" + _case_id(*case), B, H, H_kv, T, S, D, causal, dtype, layout,
                           device="cuda")


@pytest.mark.gpu
@sm90
def test_gluon_unordered_dq_with_documents(gluon, monkeypatch):
    monkeypatch.setenv(backends.DETERMINISTIC_VARIABLE, "0")
    dtype, B, H, H_kv, D, layout, lengths = GPU_DOC_CASES[2]
    T = sum(lengths[0])
    _check_against_float64(f"gluon-unordered-docs-{lengths}", B, H, H_kv, T, T, D, True, dtype, layout, "cuda",
                           doc_ids=_doc_ids(lengths, "cuda"))


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
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_later_launches_use_the_new_tensors(D, documents, gluon):
    # the first call per layout goes through Triton's front door; later calls launch the compiled
    # kernels with descriptors rebuilt from the new tensors' addresses (and the new documents')
    from kernels.hopper import bwd, fwd
    a, b = (_make_inputs(f"gluon-rebind-{name}-{D}", 1, 4, 2, 1000, 1000, D, BF16, "bthd", "cuda") for name in "ab")
    doc_ids = _doc_ids([[300, 1, 699]], "cuda") if documents else None

    def run(q, k, v, do):
        o = flash_attention(q, k, v, doc_ids=doc_ids)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    fwd._BOUND.clear()
    bwd._BOUND.clear()
    first_b = run(*b)
    later_a, later_b = run(*a), run(*b)
    fwd._BOUND.clear()
    bwd._BOUND.clear()
    first_a = run(*a)
    for first, later in ((first_a, later_a), (first_b, later_b)):
        for x, y in zip(first, later, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(first_a[0], first_b[0])


def _poisoned_grads(q, k, v, do, doc_ids, window):
    """o, lse, dq, dk, dv of one forward and backward whose outputs may get memory that held NaN
    just before (freed at once, the caching allocator may hand the blocks on): a tile a launch
    skipped would keep it. dq is scaled from a zeroed accumulator, so only its value shows a
    skipped tile; the CUDA graphs below fill every output with NaN before each replay."""
    poison = [torch.full_like(x, float("nan")) for x in (q, q, k, k)]
    poison.append(torch.full(q.shape[:3], float("nan"), device=q.device))
    del poison
    o, lse = flash_attn_forward(q, k, v, doc_ids=doc_ids, window=window)
    return (o, lse, *flash_attn_backward(do, q, k, v, o, lse, doc_ids=doc_ids, window=window))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_kernels_take_every_tile_once(D, gluon, monkeypatch):
    # persistent, the forward's and the backward's programs take tiles from counters zeroed for
    # each launch; a program per tile computes the same bits (the backward's dQ in its fixed order).
    # More tiles than SMs (up to ~4 a program, so that the rings and the tile ring wrap), fewer,
    # documents (tiles of unequal length, some with no steps), a window, longest first (D = 128
    # from 8192 keys); launches in a row, on a second stream, and from two CUDA graphs replayed in
    # reverse order
    docs = [1, 700, 1300, 64, 33, 1950]
    cases = [(4, 8, 2, 3000, None, 0), (1, 2, 2, 300, None, 0), (2, 4, 2, 4048, [docs, [4048]], 0),
             (4, 8, 4, 4048, [docs, [4048], docs[::-1], [2024, 2024]], 0), (1, 8, 8, 8192, None, 0),
             (1, 8, 8, 8192, [[3000, 5192]], 1024)]
    variables = (hopper.FWD_PERSISTENT_VARIABLE, hopper.BWD_PERSISTENT_VARIABLE)
    for B, H, H_kv, T, lengths, window in cases:
        q, k, v, do = _make_inputs(f"gluon-persistent-{D}-{T}", B, H, H_kv, T, T, D, BF16, "packed", "cuda")
        doc_ids = _doc_ids(lengths, "cuda") if lengths else None
        for variable in variables:
            monkeypatch.setenv(variable, "0")
        per_tile = _poisoned_grads(q, k, v, do, doc_ids, window)
        for variable in variables:
            monkeypatch.setenv(variable, "1")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    for x, y in zip(_poisoned_grads(q, k, v, do, doc_ids, window), per_tile, strict=True):
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
            for x, y in zip(out, per_tile, strict=True):
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
    flash_attn_backward(do, q, k, v, o, lse)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _hold_sm[(holders,)](flag, arrived, released, polls, num_warps=1)
    _wait_for[(1,)](arrived, holders, seen, polls, num_warps=1)  # every holder is on its SM
    grads = flash_attn_backward(do, q, k, v, o, lse)
    flag.fill_(1)
    torch.cuda.synchronize()
    return holders, seen.item(), released.eq(1).sum().item(), grads


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_backward_finishes_while_another_kernel_holds_most_sms(persistent, gluon, monkeypatch):
    # dQ's fixed order makes a backward tile wait on the tiles before it, so those must be tiles
    # that running programs hold, whatever else runs (a program per tile: the GPU starts a grid's
    # programs in order; persistent: a program takes every tile from the counter once it runs).
    # With every SM but 4 held by another kernel until this backward is done, it ends on the 4,
    # and the flag set after it releases the holders, not their poll limit
    monkeypatch.setenv(hopper.BWD_PERSISTENT_VARIABLE, persistent)
    monkeypatch.setenv(backends.DETERMINISTIC_VARIABLE, "1")  # dQ's order: the waits under test
    q, k, v, do = _make_inputs("gluon-held-sms", 2, 8, 8, 4096, 4096, 128, BF16, "packed", "cuda")
    o, lse = flash_attn_forward(q, k, v)
    expected = flash_attn_backward(do, q, k, v, o, lse)
    holders, started, released, grads = held_backward(q, k, v, do, o, lse)
    assert started == holders, f"{started} of {holders} holders had started before the backward"
    assert released == holders, f"{holders - released} of {holders} holders stopped by their poll limit"
    for x, y in zip(grads, expected, strict=True):
        assert torch.equal(x, y)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("variable", list(VARIANTS))
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_schedule_variants_match_float64_reference(variable, D, gluon, monkeypatch):
    # each variant reorders work or waits, never the arithmetic, but FWD_EXP2_FMA, which takes a share
    # of the forward's exponentials as a cubic: odd T, T < S and T > S (causal, bottom-right), GQA,
    # documents and a window against float64, and a backward with the same bits every run
    if variant(variable, D) is None:
        pytest.skip(f"{variable} has one value at head dim {D}")
    monkeypatch.setenv(variable, variant(variable, D))
    dtype = BF16
    _check_against_float64(f"gluon-{variable}-odd-{D}", 2, 4, 2, 2049, 2049, D, True, dtype, "packed", "cuda")
    for T, S in ((777, 1500), (1500, 777)):
        _check_against_float64(f"gluon-{variable}-T{T}-S{S}-{D}", 1, 4, 2, T, S, D, True, dtype, "bthd", "cuda")
    _check_against_float64(f"gluon-{variable}-full-{D}", 1, 4, 1, 1000, 1000, D, False, dtype, "bthd", "cuda")
    lengths = [[1, 700, 1300, 64, 33, 1950], [4048]]
    _check_against_float64(f"gluon-{variable}-docs-{D}", 2, 4, 2, 4048, 4048, D, True, dtype, "packed", "cuda",
                           doc_ids=_doc_ids(lengths, "cuda"))
    _check_against_float64(f"gluon-{variable}-window-{D}", 1, 8, 2, 3000, 3000, D, True, dtype, "bthd", "cuda",
                           window=700)
    q, k, v, do = _make_inputs(f"gluon-{variable}-determinism-{D}", 2, 8, 2, 2048, 2048, D, dtype, "packed", "cuda")
    o = flash_attention(q, k, v)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(o, (q, k, v), do), strict=True):
        assert torch.equal(a, b)
