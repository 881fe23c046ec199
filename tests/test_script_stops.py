"""Every script stops on a signal at once, in one line, with exit code 128 + the signal's number.

Real processes, real signals (scripts/stopping.py is the mechanism):
- loss_equivalence.py stopped by SIGTERM or Ctrl-C (SIGINT) during its first attention's run, or
  as that run closes, says so in one line, starts no other run, gives no verdict and writes no
  result;
- sample.py stopped while it generates: one line, exit 143, no traceback;
- a script stopped while torch.compile builds its kernels ends then, building no more of them;
- on a GPU, every benchmark script stopped after its first printed row: one line, exit 143, no
  traceback, no file torn (each is written whole or not at all).
The CPU tests start five processes (a few minutes on 2 busy cores):

    .venv/bin/python -m pytest tests/test_script_stops.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train as train_module
from tests.helpers import REPO, TINY, catches, compose, metrics, start, wait_for, wandb_file
from tests.wandb_records import ending

pytestmark = pytest.mark.slow


def stopped(proc: subprocess.Popen, cwd: Path, sig: int, script: str) -> str:
    """Sends sig; the one line the script said about it, having checked the exit code and that no
    traceback came."""
    proc.send_signal(sig)
    proc.wait(timeout=600)
    err = (cwd / "err.log").read_text()
    lines = [line for line in err.splitlines() if "stopped by" in line]
    assert proc.returncode == 128 + sig, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{script}: stopped by {signal.Signals(sig).name}; "), err[-2000:]
    assert "Traceback" not in err and "resume=" not in err, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_loss_equivalence_says_so_and_gives_no_verdict(sig, data_root, tmp_path):
    out = tmp_path / "check"
    proc = start([str(REPO / "scripts" / "loss_equivalence.py"), *TINY, f"data.root={data_root}",
                  "max_steps=1000000", "attns=[sdpa,naive]", "wandb.mode=disabled", f"hydra.run.dir={out}"], tmp_path)
    wait_for(proc, tmp_path, lambda: len(metrics(out / "sdpa")) >= 2, "sdpa's second step")
    line = stopped(proc, tmp_path, sig, "loss_equivalence.py")
    assert line.endswith(f"no verdict: the check compares whole runs (its runs stay in {out}: run it again into "
                         "another hydra.run.dir, or after removing that dir)"), line
    said = (tmp_path / "out.log").read_text()
    assert "verdict" not in said and "resume" not in said and "train further" not in said, said[-2000:]
    assert not (out / "naive").exists() and not list(out.glob("equivalence.*"))
    # the advice holds: the same command again is refused in one line, and changes nothing
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    again = subprocess.run([sys.executable, *proc.args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: hydra.run.dir={out} holds the runs of an earlier check (sdpa): the check trains every attention "
        "from step 0: choose another hydra.run.dir, or remove that dir"), again.stderr[-2000:]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_stop_as_a_run_of_loss_equivalence_closes_stops_the_script_there(data_root, tmp_path):
    # sent once sdpa's summary.json is written: W&B's close and curves.png follow it, and a stop then
    # leaves sdpa's run whole (status ok) but still stops the check before naive's run
    out = tmp_path / "check"
    proc = start([str(REPO / "scripts" / "loss_equivalence.py"), *TINY, f"data.root={data_root}", "max_steps=2",
                  "attns=[sdpa,naive]", "wandb.mode=offline", f"hydra.run.dir={out}"], tmp_path)
    wait_for(proc, tmp_path, lambda: (out / "sdpa" / "summary.json").exists(), "sdpa's summary.json")
    stopped(proc, tmp_path, signal.SIGTERM, "loss_equivalence.py")
    assert json.loads((out / "sdpa" / "summary.json").read_text())["status"] == "ok"
    assert ending(wandb_file(out / "sdpa"))["exit_code"] == 0  # its W&B run closed whole, the service waited for
    assert not (out / "naive").exists() and not list(out.glob("equivalence.*"))


def _compilers(cache: Path) -> list[int]:
    """The processes building a kernel into cache (Inductor's C++ compiler runs, whoever their parent)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(cache) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # ended while we looked
            continue
    return pids


def _kernels(cache: Path) -> int:
    """Kernels built into cache so far (os.walk: Inductor makes and removes folders there as it goes)."""
    return sum(name.endswith(".so") for _, _, names in os.walk(cache) for name in names)


def test_a_stop_while_torch_compile_builds_kernels_ends_the_script_at_once(tmp_path):
    # Python's own exit would first build every kernel still queued in Inductor's compile threads
    # (41 here); the stop ends the script with the compilers already running, and no more start
    cache = tmp_path / "inductor"
    proc = start([str(REPO / "tests" / "compile_stop_worker.py")], tmp_path,
                 {"TORCHINDUCTOR_CACHE_DIR": str(cache)})  # a new cache: every kernel is built
    try:
        # two kernels built: every other one is queued by then, its compile job submitted
        wait_for(proc, tmp_path, lambda: _kernels(cache) >= 2, "the second kernel")
        before = _kernels(cache)
        stopped(proc, tmp_path, signal.SIGTERM, "compile_stop_worker.py")
    finally:
        proc.kill()  # where the test failed first: no compiler left running for minutes
        proc.wait()
    deadline = time.monotonic() + 300
    while _compilers(cache) and time.monotonic() < deadline:  # those running finish, orphaned
        time.sleep(0.1)
    built = _kernels(cache)
    # the two compile threads' kernels in flight, and a few more where the stop waited on a busy machine
    assert built <= before + 6, f"{built} kernels built, {before} at the stop: the exit ran the queued jobs"
    assert "compiled" not in (tmp_path / "out.log").read_text()


@pytest.fixture(scope="module")
def checkpoint(data_root, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("stops") / "run"
    train_module.train(compose(TINY + [f"data.root={data_root}", "max_steps=2", "wandb.mode=disabled"]), run_dir)
    return run_dir


def test_a_stopped_sample_says_so_in_one_line(checkpoint, tmp_path):
    # a million tokens, each recomputing the forward of the last max_seq_len: it runs until stopped
    proc = start([str(REPO / "scripts" / "sample.py"), f"ckpt={checkpoint}", "max_new_tokens=1000000",
                  "kv_cache=false", "device=cpu"], tmp_path)
    # SIGALRM caught: stoppable's handlers are in place (its retry timer's), past sample.py's imports
    wait_for(proc, tmp_path, lambda: catches(proc.pid, signal.SIGALRM), "the stop armed")
    stopped(proc, tmp_path, signal.SIGTERM, "sample.py")
    assert (tmp_path / "out.log").read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["err.log",
                                                                                                      "out.log"]


# each benchmark with small arguments, stopped once it printed this many lines (its first row)
GPU_SCRIPTS = {
    "bench_attention.py": (["--seq-lens", "1024,2048,4096", "--head-dims", "64", "--out", "{out}"], 3),
    "bench_loss.py": (["--tokens", "8192,16384"], 5),
    "bench_decode.py": (["--batches", "1,4", "--cache-lens", "1024,4096"], 2),
    "tune_attention.py": (["--seq-lens", "1024", "--head-dims", "64"], 1),
    "profile_attention.py": (["--seq-lens", "4096,8192", "--head-dims", "64", "--steps", "50"], 3),
    "host_overhead.py": ([], 2),
    "long_context.py": (["--attns", "sdpa", "--acs", "none", "--min", "1024", "--max", "65536", "--out", "{out}",
                         "max_steps=3"], 1),
    "context_parallel.py": (["--gpus", "1", "--seq-lens", "8192,16384,32768", "--steps", "20", "--out", "{out}"], 1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_every_benchmark_stops_in_one_line_with_its_files_whole(script, tmp_path):
    args, lines = GPU_SCRIPTS[script]
    out = tmp_path / "results"
    proc = start([str(REPO / "scripts" / script), *(a.format(out=out) for a in args)], tmp_path)
    wait_for(proc, tmp_path, lambda: len((tmp_path / "out.log").read_text().splitlines()) >= lines,
             f"{script}'s first row")
    stopped(proc, tmp_path, signal.SIGTERM, script)
    assert not [p for p in tmp_path.rglob("*.tmp")], list(tmp_path.rglob("*"))
