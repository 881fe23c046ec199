"""A stop signal stops at its next safe point, in setup and in the processes a run is made of: real
train.py processes, real signals.

- SIGTERM to the process, or SIGTERM or Ctrl-C (SIGINT) to its whole process group, while a dataset
  is streamed, right as tokenizing starts, and while several worker processes tokenize it: exit
  128 + the signal within a minute, one line saying nothing was saved, no traceback, no dataset
  dir half-made, no run dir, and no worker left behind;
- SIGTERM while the run waits for another process to finish preparing the dataset: the same;
- kill -9 of train.py or scripts/prepare_data.py while its workers tokenize: the workers die with
  it, and the same command takes its locks over, saying so, and prepares the dataset;
- a process forked under StopSignals (a tokenizing worker) dies by SIGTERM as a process without
  the run's handler does;
- SIGTERM to a script that runs train.py as a child (scripts/context_parallel.py) goes on to it,
  and kill -9 of the script has the kernel send it SIGTERM: the child checkpoints and exits 143, and
  no process is left behind;
- NVRTC compiling, as cuDNN's first attention call makes it do (the NVRTC of torch's CUDA 13.0
  wheels, which `make test` puts in .venv/nvrtc): in a bare process its first compile puts NVRTC's
  own SIGTERM handler in place (which exits 4, or hangs the process); inside a script's stoppable or
  a run's StopSignals, which make the process's first NVRTC compile as they start, a later compile
  leaves Python's handler in place, and SIGTERM stops the process as theirs do.

    .venv/bin/python -m pytest tests/test_stops.py -q      # about three minutes on 2 cores
"""

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, wait_for
from trainer.checkpoint import load_checkpoint
from trainer.metrics import read_metrics
from trainer.signals import StopSignals

DOCS = 100_000  # enough for several tokenizing workers (one per 10,000 documents, one per core at most)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = "the a king queen lord lady sword crown night day love war speak hear come go".split()
    with open(corpus / "train.jsonl", "w") as f:
        for _ in range(DOCS):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))}) + "\n")
    return corpus


def preparing(corpus: Path, tmp_path: Path, program: str = "train.py") -> list[str]:
    """The command of train.py (or scripts/prepare_data.py) preparing the corpus as dataset `big`."""
    if program == "train.py":
        return [sys.executable, str(REPO / "train.py"), *TINY, "wandb.mode=disabled", "max_steps=3", "data=tinystories",
                "data.name=big", f"data.hf_path={corpus}", f"data.root={tmp_path / 'data'}",
                f"hydra.run.dir={tmp_path / 'run'}"]
    return [sys.executable, str(REPO / program), "tinystories", "name=big", f"hf_path={corpus}",
            f"root={tmp_path / 'data'}"]


def start(corpus: Path, tmp_path: Path, program: str = "train.py") -> tuple[subprocess.Popen, Path]:
    """The program preparing the corpus, in a process group of its own (Ctrl-C as a terminal sends
    it: to the group, SIGINT not ignored)."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen(preparing(corpus, tmp_path, program), cwd=tmp_path, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def workers_tokenize(proc: subprocess.Popen, log: Path) -> bool:
    """Tokenizing has begun and the worker processes are up (children of train.py)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return "tokenizing" in log.read_text() and len(children) >= 2


def eventually(done, seconds: float, failure) -> None:
    """Until done() holds, for `seconds` at most; failure() is the assertion's message past that."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, failure()
        time.sleep(0.05)


def group_gone(pgid: int) -> bool:
    """Whether no process is left in process group pgid."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def gone(pid: int) -> bool:
    """Whether process pid has ended (a zombie that no one reaped has ended too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_stopped_cleanly(proc: subprocess.Popen, log: Path, tmp_path: Path, sig: signal.Signals) -> None:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"train.py still running 60 s after {sig.name}: {log.read_text()[-2000:]}")
    text = log.read_text()
    assert proc.returncode == 128 + sig, text[-2000:]
    said = [line for line in text.splitlines() if line.startswith("stopped by")]
    assert said == [f"stopped by {sig.name} before the first step; nothing was saved: the same command starts the "
                    "run again"], text[-2000:]
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    assert not (tmp_path / "data" / "big").exists() and not (tmp_path / "run").exists()
    eventually(lambda: group_gone(proc.pid), 60, lambda: "a worker process outlived train.py")  # its workers too


CASES = {  # when, what is signalled, which signal
    "while streaming": ("Generating train split", "process", signal.SIGTERM),
    "as tokenizing starts": ("tokenizing", "process", signal.SIGTERM),
    "while workers tokenize": (workers_tokenize, "process", signal.SIGTERM),
    "to the group while workers tokenize": (workers_tokenize, "group", signal.SIGTERM),
    "ctrl-c while workers tokenize": (workers_tokenize, "group", signal.SIGINT),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_stop_while_a_dataset_is_prepared_ends_setup_and_leaves_nothing(case, corpus, tmp_path):
    when, target, sig = CASES[case]
    if callable(when) and (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the dataset is tokenized in the process itself, without workers")
    proc, log = start(corpus, tmp_path)
    reached = (lambda: when(proc, log)) if callable(when) else (lambda: when in log.read_text())
    wait_for(proc, tmp_path, reached, case, log=log.name)
    (os.killpg if target == "group" else os.kill)(proc.pid, sig)
    assert_stopped_cleanly(proc, log, tmp_path, sig)


@pytest.mark.slow
def test_sigterm_to_prepare_datas_group_while_workers_tokenize_is_its_one_line(corpus, tmp_path):
    # as SLURM's scancel or a closed terminal sends it: to the workers too, whose deaths break the pool
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the dataset is tokenized in the process itself, without workers")
    proc, log = start(corpus, tmp_path, "scripts/prepare_data.py")
    wait_for(proc, tmp_path, lambda: workers_tokenize(proc, log), "workers tokenize", log=log.name)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode == 143, text[-2000:]
    assert "prepare_data.py: stopped by SIGTERM; a dataset not finished has no meta.json: the same command prepares " \
           "it" in text and "Traceback" not in text, text[-3000:]
    assert not (tmp_path / "data" / "big").exists()


@pytest.mark.slow
@pytest.mark.parametrize("program", ["train.py", "scripts/prepare_data.py"])
def test_kill_9_while_workers_tokenize_leaves_no_worker_and_the_same_command_takes_over(program, corpus, tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the dataset is tokenized in the process itself, without workers")
    proc, log = start(corpus, tmp_path, program)
    wait_for(proc, tmp_path, lambda: workers_tokenize(proc, log), "workers tokenize", log=log.name)
    workers = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    proc.kill()
    proc.wait(timeout=60)
    # the workers die with it: none is left holding its locks
    eventually(lambda: all(gone(pid) for pid in workers), 60,
               lambda: f"workers outlived their parent: {[p for p in workers if not gone(p)]}")
    again = subprocess.run(preparing(corpus, tmp_path, program), cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    killed = f"process {proc.pid} on {socket.gethostname()}"
    assert f"data: {killed} ended while preparing {tmp_path / 'data' / 'big'} (killed?); this process takes it " \
           "over" in again.stderr, again.stderr[-2000:]
    if program == "train.py":
        assert f"run dir {tmp_path / 'run'}: {killed} ended without closing it (killed?); this run takes it over" \
               in again.stderr, again.stderr[-2000:]


@pytest.mark.slow
def test_a_stop_while_waiting_for_another_preparer_ends_setup(corpus, tmp_path):
    (tmp_path / "data").mkdir()
    fd = os.open(tmp_path / "data" / ".big.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as another process preparing the same dataset holds it
    try:
        proc, log = start(corpus, tmp_path)
        wait_for(proc, tmp_path, lambda: "data: waiting for" in log.read_text(), "wait for the dataset's lock",
                 log=log.name)
        os.kill(proc.pid, signal.SIGTERM)
        assert_stopped_cleanly(proc, log, tmp_path, signal.SIGTERM)
    finally:
        os.close(fd)


def test_a_child_forked_under_stop_signals_dies_by_sigterm():
    ready, ready_w = os.pipe()
    with StopSignals():
        pid = os.fork()
        if pid == 0:  # the child: says it runs (a signal before that, Python drops), then works until a signal
            try:
                os.write(ready_w, b"1")
                time.sleep(30)
            finally:
                os._exit(0)
        os.read(ready, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(ready)
    os.close(ready_w)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_stop_signal_to_a_script_goes_on_to_the_train_py_it_runs(sig, data_root, tmp_path):
    # context_parallel.py needs GPUs as a whole; the part that runs each train.py is the same on the CPU
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), *TINY, f"data.root={data_root}", "wandb.mode=disabled",
           "log_interval=1", "eval_interval=0", "ckpt_interval=1000", "max_steps=100000", f"hydra.run.dir={run_dir}"]
    code = ("import json, os, sys; sys.path.insert(0, os.getcwd()); from scripts.context_parallel import run_child; "
            f"done, stopped = run_child({cmd!r}, dict(os.environ)); print(json.dumps([done.returncode, stopped]))")
    script = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")), default=0) < 2:
        assert script.poll() is None and time.monotonic() < deadline, script.communicate()[1][-2000:]
        time.sleep(0.05)
    os.kill(script.pid, sig)  # the script alone, as a scheduler stopping it would (or kill -9: the kernel's SIGTERM)
    out, err = script.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert json.loads(out.strip().splitlines()[-1]) == [143, signal.SIGTERM], err[-2000:]
    # the child checkpoints the step in flight, and is gone
    eventually(lambda: group_gone(script.pid), 120, lambda: "the child outlived the script")
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert step == max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r) >= 2


NVRTC_DIR = REPO / ".venv" / "nvrtc" / "nvidia" / "cu13" / "lib"


@pytest.mark.skipif(not NVRTC_DIR.is_dir(), reason="NVRTC of CUDA 13.0 is not in .venv/nvrtc: `make test` puts it there")
@pytest.mark.parametrize("mode", ["script", "train"])
def test_a_stop_after_nvrtc_compiled_is_a_stop_not_nvrtc_exit_code_4(mode):
    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "tests" / "nvrtc_worker.py"), str(NVRTC_DIR), mode],
                              capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})

    # what the fix is for: NVRTC's handler in place during a process's first compile (its ~20 ms can
    # pass unseen on a busy machine; no signal is sent into it, which would end or hang the process)
    for _ in range(3):
        bare = run("bare")
        assert bare.returncode == 0 and "compiled" in bare.stdout, bare.stderr[-2000:]
        if "NVRTC held SIGTERM" in bare.stdout:
            break
    else:
        pytest.skip("NVRTC's handler was not seen in place in 3 bare runs: nothing to test against")
    stopped = run(mode)
    assert "compiled" in stopped.stdout
    assert "NVRTC held SIGTERM" not in stopped.stdout  # the first compile was made as the mode started
    assert stopped.returncode == 143, (stopped.returncode, stopped.stderr[-2000:])
    if mode == "script":
        assert stopped.stderr.strip().splitlines()[-1] == "nvrtc_worker.py: stopped by SIGTERM; nothing kept"
    assert "Traceback" not in stopped.stderr
