"""Nothing lost, nothing mixed, every mistake answered in one line: real train.py processes, real signals.

- SIGKILL at seeded random steps and in the middle of a checkpoint write, SIGINT, and a metrics
  line cut short: after each, resume=<dir> goes on, and the metrics equal the uninterrupted run's
  exactly, no row duplicated or missing (FAULT_SEED picks the kill points; fixed by default);
- SIGTERM, SIGUSR1 and SIGHUP (a scheduler's signals), also in the middle of a save: the step
  finishes, is checkpointed, W&B is closed as preempted, one line gives the resume command (in a
  run dir with a space and non-ASCII characters, run through the shell's reading of it), the exit
  code is 128 + the signal, and the resumed run equals the uninterrupted one; under torchrun a
  signal to one rank stops both after the same step;
- a sweep stopped by SIGTERM goes on by the command its stop line prints: each job in its own dir,
  the stopped one bit-identical to an uninterrupted run, the finished one untouched; a sweep run
  again with another seed, or into a live run's dir, rewrites no other run's files or record;
- a run killed before its first checkpoint starts again in place, by the same command or resume=;
- a checkpoint truncated, with a zeroed block, or with flipped bits, or of another format, keys,
  types or weights is refused in one line;
- a ckpt.pt that is a directory: resume= and a fresh run into its dir say so in the same one line;
- two runs into one dir: one proceeds, the other gets one line, the first's files are untouched;
  two runs started together into default dirs get one dir each;
- a diverging run stops, its last checkpoint loadable and finite, and resumes with a sane lr;
- a full disk during a save (a small tmpfs in a private mount namespace): one line, no temp file,
  the last checkpoint intact;
- bad config values, +/++/~ overrides the schema lacks, bad flags and sweep values that do not
  compose: exit code 2, one line on stderr naming the key, nothing created; a comma in a path is
  taken as typed, and one that cannot be says how to quote it;
- an online dataset without the hub: one line, nothing left; a bad sweep job: skipped with its reason.

    .venv/bin/python -m pytest tests/test_failures.py -q      # about seven minutes on 2 cores
"""

import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from configs.overrides import quoted_where_needed
from configs.schema import TrainConfig
from trainer import preflight
from trainer import checkpoint
from trainer.checkpoint import FORMAT_VERSION, CheckpointError, load_checkpoint
from trainer.metrics import json_line, read_metrics
from tests.helpers import REPO, TINY, curve, last_step, private_tmpfs_works, torchrun, wandb_file
from tests.wandb_records import ending

SEED = int(os.environ.get("FAULT_SEED", "20261122"))
BASE = TINY + ["wandb.mode=disabled", "log_interval=1", "eval_interval=0", "ckpt_interval=3", "max_steps=24"]


def command(data_root, *overrides) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *BASE, f"data.root={data_root}", *overrides]


# one CPU thread: a BLAS that adapts its thread count to the machine's load would otherwise sum in
# another order from one process to the next, and "bit for bit" would depend on the load
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start(cmd, cwd: Path, log: Path) -> subprocess.Popen:
    # SIGINT as a terminal's Ctrl-C delivers it (a background test process may have it ignored)
    out = open(log, "w")
    return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def run(cmd, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env={**ENV, **(env or {})})


def saving(run_dir: Path) -> bool:
    return any(p.name.startswith(".ckpt.pt.") for p in run_dir.iterdir()) if run_dir.exists() else False


def interrupt(proc: subprocess.Popen, until, sig: int) -> bool:
    """Sends sig once until() holds; False if the process ended first."""
    while proc.poll() is None:
        if until():
            proc.send_signal(sig)
            proc.wait(timeout=120)
            return True
        time.sleep(0.001)
    return False


def stderr_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory) -> list[tuple]:
    tmp = tmp_path_factory.mktemp("straight")
    done = run(command(data_root, f"hydra.run.dir={tmp / 'run'}"), tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return curve(tmp / "run")


# ----------------------------------------------------------------------------- interruptions


@pytest.mark.slow
def test_kills_and_ctrl_c_at_random_points_then_resume_reproduce_the_run(data_root, uninterrupted, tmp_path):
    rng = random.Random(SEED)
    kill_steps = sorted(rng.sample(range(2, 20), 2))
    run_dir = tmp_path / "run"
    legs = [(signal.SIGKILL, lambda: last_step(run_dir) >= kill_steps[0]),
            (signal.SIGINT, lambda: last_step(run_dir) >= kill_steps[1]),
            (signal.SIGKILL, lambda: saving(run_dir))]  # in the middle of writing a checkpoint
    for i, (sig, when) in enumerate(legs):
        resume = [f"resume={run_dir}"] if i else []
        proc = start(command(data_root, f"hydra.run.dir={run_dir}", *resume), tmp_path, tmp_path / f"leg{i}.log")
        assert interrupt(proc, when, sig), f"leg {i} finished before its {sig.name}: {(tmp_path / f'leg{i}.log').read_text()[-1500:]}"
        assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
        if sig == signal.SIGINT:
            assert f"add resume={run_dir} to the same command" in (tmp_path / f"leg{i}.log").read_text()
        load_checkpoint(run_dir / "ckpt.pt")  # whatever the moment of the kill, the checkpoint is whole
    assert any(p.name.startswith(".ckpt.pt.") for p in run_dir.iterdir())  # the write the last kill cut short
    with open(run_dir / "metrics.jsonl", "a") as f:  # a line cut short, as by a kill mid-append
        f.write('{"step": 99, "loss": 3.1')
    done = run(command(data_root, f"hydra.run.dir={run_dir}", f"resume={run_dir}"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert curve(run_dir) == uninterrupted  # bit-identical, every step once
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def stop_line(log: Path, signame: str) -> str:
    lines = [line for line in log.read_text().splitlines() if line.startswith(f"stopped by {signame}")]
    assert len(lines) == 1, log.read_text()[-2000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP], ids=lambda s: s.name)
def test_a_scheduler_signal_checkpoints_the_step_in_flight_and_resume_goes_on(sig, data_root, uninterrupted,
                                                                              tmp_path):
    # what SLURM (--signal), Kubernetes and torchrun send before preempting: the step finishes, a
    # checkpoint of it is written (the last periodic one is 20 steps away), W&B is closed, one line
    # says how to resume, and the exit code is the signal's (143 for SIGTERM)
    run_dir = tmp_path / "a b" / "ü_日本"  # any path the filesystem takes, as typed
    log = tmp_path / "stopped.log"
    proc = start(command(data_root, f"hydra.run.dir={run_dir}", "ckpt_interval=20", "wandb.mode=offline"),
                 tmp_path, log)
    assert interrupt(proc, lambda: last_step(run_dir) >= 4, sig), log.read_text()[-1500:]
    assert proc.returncode == 128 + sig, log.read_text()[-2000:]
    line = stop_line(log, sig.name)
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert step == last_step(run_dir) >= 4 and f"after step {step};" in line
    assert read_metrics(run_dir / "summary.json")[0]["status"] == "stopped"
    assert ending(wandb_file(run_dir)) == {"exit_code": 1, "preempting": True}  # W&B closed, as preempted
    hint = shlex.split(line.split("add ", 1)[1].split(" to the same command")[0])  # as a shell reads it
    done = run(command(data_root, f"hydra.run.dir={run_dir}", *hint), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert curve(run_dir) == uninterrupted  # bit-identical, every step once


@pytest.mark.slow
def test_sigterm_during_a_save_finishes_it_then_stops(data_root, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start(command(data_root, f"hydra.run.dir={run_dir}"), tmp_path, log)
    assert interrupt(proc, lambda: saving(run_dir), signal.SIGTERM), log.read_text()[-1500:]
    assert proc.returncode == 143, log.read_text()[-2000:]
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]  # the save in flight completed, whole
    assert step % 3 == 0 and step == last_step(run_dir) and f"after step {step};" in stop_line(log, "SIGTERM")
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_a_dataset_cut_short_while_the_run_reads_it_stops_it_in_one_line_and_resume_prepares_it_again(data_root,
                                                                                                     tmp_path):
    data = tmp_path / "data"
    shutil.copytree(Path(data_root) / "shakespeare", data / "shakespeare")
    run_dir = tmp_path / "run"
    cmd = command(data, f"hydra.run.dir={run_dir}", "max_steps=1000000")
    proc = start(cmd, tmp_path, tmp_path / "first.log")
    train_bin = data / "shakespeare" / "train.bin"
    size = train_bin.stat().st_size
    deadline = time.monotonic() + 600
    while last_step(run_dir) < 4:  # a checkpoint was written (ckpt_interval=3)
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-2000:]
        time.sleep(0.01)
    os.truncate(train_bin, size // 2)  # in place, under the reading run
    proc.wait(timeout=600)
    said = (tmp_path / "first.log").read_text().replace("\r", "\n").splitlines()[-1]
    assert proc.returncode == 1, said
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert re.fullmatch(rf"{re.escape(str(train_bin))} changed while it was read: {size // 2:,} bytes, "
                        rf"{size:,} when it was opened \(cut short, or prepared again\); the last checkpoint "
                        rf"\(step {step}\) is .*: add resume=.* to the same command to continue", said), said
    done = run(command(data, f"resume={run_dir}", f"max_steps={step + 2}"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert train_bin.stat().st_size == size
    assert [r[0] for r in curve(run_dir) if r[1] is not None][-1] == step + 2


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_again_in_place(data_root, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    for i, how in enumerate(["the same command", "resume"]):
        proc = start(command(data_root, f"hydra.run.dir={run_dir}", "ckpt_interval=20"), tmp_path, tmp_path / "kill.log")
        assert interrupt(proc, lambda: last_step(run_dir) >= 2, signal.SIGKILL)
        assert not (run_dir / "ckpt.pt").exists()
        again = [f"resume={run_dir}"] if how == "resume" else []
        done = run(command(data_root, f"hydra.run.dir={run_dir}", *again), tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        said = [line for line in done.stderr.splitlines() if "starting it again from step 0 in place" in line]
        assert len(said) == 1, (how, done.stderr[-2000:])
        assert curve(run_dir) == uninterrupted, how  # the killed run's records are gone, the new run's whole
        if i == 0:  # the second round starts from a fresh dir again
            shutil.rmtree(run_dir)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_stopped_sweep_goes_on_by_the_command_its_stop_line_gives(data_root, uninterrupted, tmp_path):
    # three jobs: the first finishes, SIGTERM stops the second, the third never starts; the stop
    # line's command continues the sweep: each job in its own dir, the finished one untouched
    base = [o for o in BASE if not o.startswith("max_steps")]
    sweep_cmd = [sys.executable, str(REPO / "train.py"), "-m", *base, f"data.root={data_root}", "max_steps=6,24,12"]
    log = tmp_path / "sweep.log"
    proc = start(sweep_cmd, tmp_path, log)
    second = lambda: max((last_step(job) for job in tmp_path.glob("multirun/*/*/1_sdpa_T32")), default=0)
    assert interrupt(proc, lambda: second() >= 4, signal.SIGTERM), log.read_text()[-1500:]
    assert proc.returncode == 143, log.read_text()[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    jobs = [sweep / f"{i}_sdpa_T32" for i in range(3)]
    assert not jobs[2].exists() and load_checkpoint(jobs[1] / "ckpt.pt")["step"] == last_step(jobs[1]) >= 4
    finished = files(jobs[0])
    assert read_metrics(jobs[0] / "summary.json")[0]["steps"] == 6
    command_ = re.fullmatch(r"stopped by SIGTERM after step \d+; .*: (\S*python\S* .*) continues the sweep \(.*\)",
                            stop_line(log, "SIGTERM"))
    assert command_, stop_line(log, "SIGTERM")
    again = shlex.split(command_.group(1))  # run as printed: this interpreter, by its path
    assert again[0] == sys.executable and f"hydra.sweep.dir={sweep.relative_to(tmp_path)}" in again
    done = run(again, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0_sdpa_T32: skipped: its run finished at step 6" in done.stderr
    assert files(jobs[0]) == finished  # not retrained, not rewritten
    assert curve(jobs[1]) == uninterrupted  # resumed in its own dir: bit-identical, every step once
    assert [r[0] for r in curve(jobs[2]) if r[1] is not None] == list(range(1, 13))
    assert [load_checkpoint(job / "ckpt.pt")["step"] for job in jobs] == [6, 24, 12]
    refused = run([*sweep_cmd, "resume=" + str(jobs[1])], tmp_path)
    assert refused.returncode == 2 and "a sweep continues by its own command" in stderr_line(refused)


@pytest.mark.slow
def test_a_sweep_never_rewrites_the_record_of_another_run(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    sweep_cmd = [sys.executable, str(REPO / "train.py"), "-m", *BASE, f"data.root={data_root}", "max_steps=2",
                 "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"]
    done = run(sweep_cmd, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    before = files(sweep)
    assert "seed: 1337" in before["0_sdpa_T32/.hydra/config.yaml"].decode()
    # the same sweep again: every job finished, is skipped, and keeps its files and its record of the
    # command that trained it; with another seed, it is refused in one line: multirun.yaml records
    # the sweep's command, and would name jobs that never ran
    again = run(sweep_cmd, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count(": skipped: its run finished at step 2") == 2
    assert files(sweep) == before
    other = run([*sweep_cmd, "seed=7"], tmp_path)
    assert other.returncode == 2 and stderr_line(other) == (
        f"error: hydra.sweep.dir={sweep} holds a sweep of other overrides (it has -; this command seed=7): continue "
        "it with its own, or choose another hydra.sweep.dir")
    assert files(sweep) == before
    # a live run in a job's dir: the job is skipped, and the live run's record and files are its own
    live_dir = tmp_path / "other" / "0_sdpa_T32"
    live = start(command(data_root, f"hydra.run.dir={live_dir}", "max_steps=1000000", "ckpt_interval=1000000"),
                 tmp_path, tmp_path / "live.log")
    deadline = time.monotonic() + 600
    while last_step(live_dir) < 1 and live.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    record = files(live_dir / ".hydra")
    skipped = run([*sweep_cmd[:-1], f"hydra.sweep.dir={live_dir.parent}"], tmp_path)
    assert live.poll() is None, (tmp_path / "live.log").read_text()[-2000:]
    assert interrupt(live, lambda: True, signal.SIGTERM)
    assert skipped.returncode == 0 and "is in use by another running train.py" in skipped.stderr, skipped.stderr[-2000:]
    assert files(live_dir / ".hydra") == record
    assert read_metrics(live_dir / "summary.json")[0]["status"] == "stopped"  # the live run's own, not "skipped"
    assert read_metrics(live_dir.parent / "1_sdpa_T32" / "summary.json")[0]["status"] == "ok"


@pytest.mark.slow
def test_the_ranks_of_a_distributed_run_stop_after_the_same_step(data_root, tmp_path):
    # SIGUSR1 to one rank only (as a signal to one task of a job): both ranks agree on the step,
    # rank 0 checkpoints it, both exit, and the run resumes under torchrun to its end
    run_dir = tmp_path / "run"
    args = [str(REPO / "train.py"), *BASE, f"data.root={data_root}", "batch_tokens=256", "max_steps=400",
            "ckpt_interval=100", f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**ENV, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 600
    while last_step(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    ranks = {int(dict(kv.split("=", 1) for kv in Path(f"/proc/{w}/environ").read_bytes().decode().split("\0")
                      if "=" in kv).get("RANK", -1)): w for w in workers}
    os.kill(ranks[1], signal.SIGUSR1)
    proc.wait(timeout=600)
    assert proc.returncode != 0
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert step == last_step(run_dir) and 3 <= step < 100, log.read_text()[-3000:]
    assert f"stopped by SIGUSR1 after step {step};" in log.read_text()
    resume = [a for a in args if not a.startswith("max_steps")] + ["max_steps=" + str(step + 3), f"resume={run_dir}"]
    torchrun(2, resume, tmp_path)
    assert [r[0] for r in curve(run_dir) if r[1] is not None] == list(range(1, step + 4))


@pytest.mark.parametrize("damage", ["truncated", "zeroed block", "flipped bits"])
def test_a_damaged_checkpoint_is_refused_in_one_line(damage, data_root, tmp_path):
    run_dir = tmp_path / "run"
    done = run(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=3"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    raw = bytearray((run_dir / "ckpt.pt").read_bytes())
    middle = len(raw) // 2
    if damage == "truncated":
        raw = raw[:middle]
    elif damage == "zeroed block":
        raw[middle:middle + 4096] = bytes(4096)
    else:
        for i in random.Random(SEED).sample(range(len(raw) // 4, len(raw)), 8):
            raw[i] ^= 0x10
    (run_dir / "ckpt.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="is damaged"):
        load_checkpoint(run_dir / "ckpt.pt")
    if damage == "zeroed block":  # and the command line says so in one line
        refused = run(command(data_root, f"resume={run_dir}", "max_steps=6"), tmp_path)
        assert refused.returncode == 2 and "is damaged" in stderr_line(refused)


@pytest.fixture(scope="module")
def good_checkpoint(data_root, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    done = run(command(data_root, f"hydra.run.dir={tmp / 'run'}", "max_steps=3"), tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "run" / "ckpt.pt"


def _rewritten(change):
    """A checkpoint edited by change(state), with a valid checksum: a file of another format or version."""
    def write(path: Path) -> None:
        state = torch.load(path, weights_only=True)
        change(state)
        state.pop("sha256")
        state["sha256"] = checkpoint._digest(state)
        torch.save(state, path)
    return write


FOREIGN = {
    "a tensor": (lambda path: torch.save(torch.zeros(3), path), "holds no checksum"),
    "an empty file": (lambda path: path.write_bytes(b""), "is damaged"),
    "a missing key": (_rewritten(lambda state: state.pop("loader")), "lacks loader"),
    "an extra key": (_rewritten(lambda state: state.update(ema={})), "has unknown ema"),
    "a newer format": (_rewritten(lambda state: state.update(format_version=FORMAT_VERSION + 1)),
                       f"is format {FORMAT_VERSION + 1}"),
    "other weights": (_rewritten(lambda state: state["model"].pop("ln_f.weight")), "does not fit this model"),
    "non-finite weights": (_rewritten(lambda state: state["model"]["ln_f.weight"].fill_(float("nan"))),
                           "holds non-finite weights"),
    "a step that is text": (_rewritten(lambda state: state.update(step="3")), "step is a str, not int"),
    "a config key from elsewhere": (_rewritten(lambda state: state["config"]["model"].update(n_expert=8)),
                                    "keys this version does not know (model.n_expert)"),
}


@pytest.mark.parametrize("kind", FOREIGN)
def test_a_foreign_checkpoint_is_refused_in_one_line(kind, good_checkpoint, data_root, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(good_checkpoint.parent, run_dir)
    damage, said = FOREIGN[kind]
    damage(run_dir / "ckpt.pt")
    refused = run(command(data_root, f"resume={run_dir}", "max_steps=6"), tmp_path)
    assert refused.returncode == 2 and said in stderr_line(refused), refused.stderr[-2000:]


@pytest.mark.parametrize("finished", [False, True], ids=["stopped run", "finished run"])
def test_a_ckpt_pt_that_is_a_directory_gets_the_same_one_line_from_resume_and_a_fresh_run(finished, tmp_path,
                                                                                          monkeypatch, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "ckpt.pt").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    if finished:
        (run_dir / "summary.json").write_text('{"status": "ok"}')
    monkeypatch.chdir(tmp_path)
    for how in (f"resume={run_dir}", f"hydra.run.dir={run_dir}"):
        with pytest.raises(SystemExit) as exit_:
            preflight.preflight([*TINY, how])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and lines == [f"error: {run_dir / 'ckpt.pt'} is a directory, not a checkpoint "
                                                   "file: remove it, or use another run dir"], (how, lines)
    kept = [".lock", "ckpt.pt", "metrics.jsonl"] + ["summary.json"] * finished
    assert sorted(p.name for p in run_dir.iterdir()) == kept


@pytest.mark.parametrize("odd", ["metrics.jsonl", "summary.json", ".hydra"])
def test_a_directory_or_file_in_a_run_files_place_is_one_line_and_touches_nothing(odd, tmp_path, monkeypatch,
                                                                                   capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if odd == ".hydra":
        (run_dir / odd).write_text("not Hydra's record")
        said = f"{run_dir / odd} is a file, not Hydra's record of a run: remove it, or use another run dir"
    else:
        (run_dir / odd).mkdir()
        said = f"{run_dir / odd} is a directory, not a file: remove it, or use another run dir"
    monkeypatch.chdir(tmp_path)
    for how in [f"hydra.run.dir={run_dir}"] + [f"resume={run_dir}"] * (odd != ".hydra"):
        with pytest.raises(SystemExit) as exit_:
            preflight.preflight([*TINY, how])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].endswith(said), (how, lines)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([".lock", odd])


def test_resume_from_another_checkpoint_file_is_refused_before_it_writes_over_a_run(good_checkpoint, tmp_path,
                                                                                   monkeypatch, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(good_checkpoint.parent, run_dir)
    shutil.copy(run_dir / "ckpt.pt", run_dir / "ckpt_step3.pt")
    before = files(run_dir)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        preflight.preflight([*TINY, "max_steps=6", f"resume={run_dir / 'ckpt_step3.pt'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and lines == [
        f"error: resume={run_dir / 'ckpt_step3.pt'}: a run goes on in its own dir, from the ckpt.pt there, and writes "
        "over that dir's ckpt.pt, metrics and summary; to go on from ckpt_step3.pt, copy it as ckpt.pt into a new dir "
        "and pass resume=<that dir>"], lines
    assert files(run_dir) == before


BAD_LAUNCH = [({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc: must be an integer >= 1"),
              ({"LOCAL_RANK": "x"}, "LOCAL_RANK=x: must be an integer >= 0"),
              ({"RANK": "0"}, "RANK=0: comes with WORLD_SIZE and LOCAL_RANK"),
              ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2: must be below WORLD_SIZE 2")]


@pytest.mark.parametrize("env, said", BAD_LAUNCH, ids=[s.split(":")[0] for _, s in BAD_LAUNCH])
def test_a_bad_launch_variable_is_one_line_and_creates_nothing(env, said, data_root, tmp_path):
    done = run(command(data_root), tmp_path, env=env)
    assert done.returncode == 2 and stderr_line(done).startswith(f"error: {said}"), done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_link_to_nothing_touches_nothing(good_checkpoint, data_root, tmp_path):
    # the checkpoint lives on a volume that is not mounted: resume= and a fresh run into the dir each
    # say so in one line, and leave every file (the link too) as it was
    run_dir = tmp_path / "run"
    shutil.copytree(good_checkpoint.parent, run_dir)
    volume = tmp_path / "volume"
    volume.mkdir()
    (run_dir / "ckpt.pt").rename(volume / "ckpt.pt")
    (run_dir / "ckpt.pt").symlink_to(volume / "ckpt.pt")
    shutil.rmtree(volume)
    before = files(run_dir)
    for how in (f"resume={run_dir}", f"hydra.run.dir={run_dir}"):
        refused = run(command(data_root, how, "max_steps=6"), tmp_path)
        assert refused.returncode == 2 and stderr_line(refused).endswith(
            f"{run_dir / 'ckpt.pt'} is a link to {volume / 'ckpt.pt'}, which does not exist (a disk not mounted?): "
            "nothing was touched; mount it or mend the link, then run again"), (how, refused.stderr[-2000:])
        assert files(run_dir) == before and (run_dir / "ckpt.pt").is_symlink()


def test_a_damaged_line_in_the_metrics_is_refused_by_resume_and_its_mend_works(good_checkpoint, data_root, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(good_checkpoint.parent, run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:1] + ['{"step": 2, "lo\n'] + lines[1:]))
    before = files(run_dir)
    refused = run(command(data_root, f"resume={run_dir}", "max_steps=6"), tmp_path)
    line = stderr_line(refused)
    assert refused.returncode == 2 and line.startswith(f"error: resume={run_dir}: {run_dir / 'metrics.jsonl'}, line 2, "
                                                       "is not JSON: "), line
    assert files(run_dir) == before
    mend = re.search(r"delete that line \((sed .*)\) and resume again", line)[1]
    assert subprocess.run(mend, shell=True, cwd=tmp_path).returncode == 0
    assert (run_dir / "metrics.jsonl").read_text() == "".join(lines)
    done = run(command(data_root, f"resume={run_dir}", "max_steps=6"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r[0] for r in curve(run_dir) if r[1] is not None] == list(range(1, 7))


def test_a_checkpoint_over_the_file_size_limit_is_that_not_a_full_disk(data_root, tmp_path):
    # errors are told apart by errno: EFBIG is its own line, where the text of torch.save's error
    # ("unexpected pos") once made it a full disk
    run_dir = tmp_path / "run"
    done = subprocess.run(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=3"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=ENV,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY)))
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == (
        f"{run_dir / 'ckpt.pt'} cannot be written: File too large (temp file removed; nothing written); no checkpoint "
        "was written"), done.stderr[-2000:]
    assert not list(run_dir.glob(".ckpt.pt.*"))


# ----------------------------------------------------------------------------- runs side by side


@pytest.mark.slow
def test_two_runs_into_one_dir_one_proceeds_the_other_is_refused(data_root, tmp_path):
    run_dir = tmp_path / "shared"
    procs = [start(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=6", f"optim.lr={lr}"), tmp_path,
                   tmp_path / f"{lr}.log") for lr in ("1e-3", "3e-3")]
    codes = [p.wait(timeout=600) for p in procs]
    assert sorted(codes) == [0, 2], codes
    winner = ("1e-3", "3e-3")[codes.index(0)]
    loser_log = (tmp_path / f"{('1e-3', '3e-3')[codes.index(2)]}.log").read_text().strip().splitlines()
    assert loser_log[-1].startswith("error: run dir") and ("in use by another" in loser_log[-1]
                                                           or "already holds a run" in loser_log[-1])
    assert f"optim.lr={winner}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert [r[0] for r in curve(run_dir)] == [1, 2, 3, 4, 5, 6, 6]  # six steps and the final eval, once each
    # the same command again is refused too: the dir holds a finished run
    again = run(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=6"), tmp_path)
    assert again.returncode == 2 and "already holds a run" in stderr_line(again)


@pytest.mark.slow
def test_two_runs_started_together_get_a_default_dir_each(data_root, tmp_path):
    procs = [start(command(data_root, "max_steps=2"), tmp_path, tmp_path / f"{i}.log") for i in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    runs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(runs) == 2
    for run_dir in runs:
        assert [r[0] for r in curve(run_dir)] == [1, 2, 2]


# ----------------------------------------------------------------------------- divergence, full disk


@pytest.mark.slow
def test_a_diverging_run_keeps_its_last_good_checkpoint(data_root, tmp_path):
    run_dir = tmp_path / "run"
    good = run(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=6", "optim.lr=1e-3"), tmp_path)
    assert good.returncode == 0, good.stderr[-2000:]
    # the lr raised on resume blows the run up before its next checkpoint (step 9)
    diverged = run(command(data_root, f"resume={run_dir}", "optim.lr=1e4"), tmp_path)
    assert diverged.returncode == 1
    line = [x for x in diverged.stderr.splitlines() if "training diverged" in x]
    assert len(line) == 1 and "the last checkpoint (step 6)" in line[0], diverged.stderr[-2000:]
    state = load_checkpoint(run_dir / "ckpt.pt")  # verified, and save_checkpoint never writes NaN or inf
    assert state["step"] == 6 and all(torch.isfinite(t).all() for t in state["model"].values())
    assert read_metrics(run_dir / "summary.json")[0]["status"] == "diverged"
    resumed = run(command(data_root, f"resume={run_dir}", "optim.lr=1e-3", "max_steps=9"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert all(r[1] is not None for r in curve(run_dir) if r[3] is None)  # every logged loss finite


@pytest.mark.slow
@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and tmpfs mounts for a private small disk")
@pytest.mark.parametrize("processes", [1, 2], ids=["one-file", "fsdp-shards"])
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(processes, data_root, tmp_path):
    # a ~20 MB checkpoint on a 30 MB disk: the first save fits, the second cannot (the old file, or
    # shards, stay until the new ones are whole); everything is checked inside the namespace, where
    # the disk exists. Sharded: every process writes its shards, and each learns that one failed
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = command(data_root, f"hydra.run.dir={disk / 'run'}", "ckpt_interval=3", "max_steps=9")
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *cmd[1:],
               "parallel.dp=fsdp", "batch_tokens=256"]
    check = ("import json, sys; from pathlib import Path; from trainer.checkpoint import load_checkpoint; "
             f"run = Path({str(disk / 'run')!r}); ckpt = load_checkpoint(run / 'ckpt.pt'); "
             "print(json.dumps({'step': ckpt['step'], 'files': sorted(p.name for p in run.iterdir()), "
             "'shards': sorted(p.name for p in run.glob('shards/*'))}))")
    script = ('mount -t tmpfs -o size=30m tmpfs "$1" && shift && "$@"; echo "rc=$?"; '
              f'"{sys.executable}" -c "$CHECK"')
    done = run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), *cmd], REPO,
               env={"CHECK": check, "PYTHONPATH": str(REPO)})
    out = done.stdout.strip().splitlines()
    assert "rc=1" in out, done.stdout[-2000:] + done.stderr[-2000:]
    said = done.stdout + done.stderr
    message = [line for line in said.splitlines() if "disk full" in line and "last checkpoint" in line]
    assert len(message) == 1 and "the last checkpoint (step 3)" in message[0], said[-3000:]
    result = eval(out[-1])  # the JSON printed by CHECK: true/false never occur in it
    assert result["step"] == 3 and not [f for f in result["files"] if f.endswith(".tmp")]
    assert len(result["shards"]) == (processes > 1)  # the step-3 shards alone: the cut ones were removed


# ----------------------------------------------------------------------------- what a run needs at its end


@pytest.mark.parametrize("cache", ["empty", "read-only"])
def test_a_bad_tokenizer_cache_is_one_line_before_the_first_step(cache, data_root, tmp_path):
    # the sample at the end needs the tokenizer: a cache it cannot be loaded from is found in setup
    cmd = command(data_root, f"hydra.run.dir={tmp_path / 'run'}", "sample_tokens=5")
    if cache == "empty":
        done = run(cmd, tmp_path, env={"TIKTOKEN_CACHE_DIR": ""})
    else:
        if not private_tmpfs_works():
            pytest.skip("needs unshare -rm and tmpfs mounts for a read-only cache")
        (tmp_path / "cache").mkdir()
        done = run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$1" && shift && exec "$@"', "sh",
                    str(tmp_path / "cache"), *cmd], tmp_path, env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr[-2000:]
    line = stderr_line_after_logging(done)
    assert line.startswith("error: TIKTOKEN_CACHE_DIR") and "point it at a writable directory" in line
    assert not (tmp_path / "run").exists()  # no step ran, nothing was kept


@pytest.mark.slow
def test_a_run_killed_in_its_epilogue_is_finished_by_resume(data_root, tmp_path):
    # killed while it generates its sample, after its last checkpoint: it trained, but has no summary
    run_dir = tmp_path / "run"
    cmd = command(data_root, f"hydra.run.dir={run_dir}", "max_steps=4", "ckpt_interval=0", "sample_tokens=3000",
                  "wandb.mode=offline")
    proc = start(cmd, tmp_path, tmp_path / "first.log")
    assert interrupt(proc, lambda: (run_dir / "ckpt.pt").exists(), signal.SIGKILL)
    assert not (run_dir / "summary.json").exists()
    trained = curve(run_dir)
    done = run(cmd + [f"resume={run_dir}", "sample_tokens=5"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"finishing {run_dir}: it trained to step 4 but did not finish (no summary)" in done.stdout
    summary = read_metrics(run_dir / "summary.json")[0]
    assert summary["status"] == "ok" and summary["steps"] == 4 and summary["sample"].startswith("ROMEO:")
    assert summary["final_loss"] == trained[-2][1] and summary["final_val_loss"] == trained[-1][3]
    assert curve(run_dir) == trained  # nothing trained twice
    assert ending(wandb_file(run_dir)) == {"exit_code": 0, "preempting": False}
    again = run(cmd + [f"resume={run_dir}"], tmp_path)
    assert again.returncode == 2 and "already finished at step 4" in stderr_line(again)


# ----------------------------------------------------------------------------- mistakes


BAD_VALUES = [
    ("seq_len=0", "seq_len"), ("seq_len=-5", "seq_len"), ("batch_size=0", "batch_size"),
    ("grad_accum=0", "grad_accum"), ("max_steps=0", "max_steps"), ("log_interval=0", "log_interval"),
    ("eval_steps=-1", "eval_steps"), ("eval_interval=-1", "eval_interval"), ("ckpt_interval=-2", "ckpt_interval"),
    ("seed=-1", "seed"), ("batch_tokens=100", "batch_tokens"), ("model.n_layer=-1", "model.n_layer"),
    ("model.n_head=3", "model.d_model"), ("model.n_kv_head=3", "model.n_kv_head"),
    ("model.n_kv_head=-1", "model.n_kv_head"), ("attn.window=-1", "attn.window"),
    ("model.vocab_size=100", "model.vocab_size"),
    ("model.dropout=1.5", "model.dropout"), ("model.max_seq_len=16", "seq_len"),
    ("model.rope_theta=0", "model.rope_theta"), ("optim.lr=-1e-3", "optim.lr"), ("optim.lr=nan", "optim.lr"),
    ("optim.beta1=1.0", "optim.beta1"), ("optim.beta2=-0.1", "optim.beta2"), ("optim.eps=0", "optim.eps"),
    ("optim.weight_decay=-1", "optim.weight_decay"), ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.grad_clip=-1", "optim.grad_clip"), ("data.name=..", "data.name"), ("data.name=a/b", "data.name"),
    ("data.val_fraction=1.0", "data.val_fraction"), ("data=tinystories data.hf_path=null", "data.hf_path"),
    ("sample_tokens=5 sample_prompt=''", "sample_prompt"), ("wandb.project=''", "wandb.project"),
    ("device=tpu", "device"), ("device=cuda:99", "device"),
    ("attn=triton model.n_head=1 model.d_model=512", "model.d_model"),
    ("model.pos_emb=rope model.n_head=32 model.d_model=96", "model.d_model"),
    ("seq_len=abc", "seq_len"), ("model.pos_emb=alibi", "model.pos_emb"), ("dtype=fp16", "dtype"),
    ("wandb.mode=on", "wandb.mode"), ("attn.sdpa_backend=fast", "attn.sdpa_backend"),
    ("compile_mode=reduce-overhead", "compile_mode"), ("compile_mode=fast", "compile_mode"),
    ("model.n_layers=4", "model.n_layers=4: no such key (did you mean model.n_layer?)"),
    ("lr=3e-4", "lr=3e-4: no such key (did you mean optim.lr?); every key, with its default: configs/schema.py"),
    ("data=nosuchdata", "nosuchdata"), ("attn=flash", "attn/flash"), ("attn=trition", "(did you mean triton?)"),
    ("seq_len", "seq_len"), ("model.loss_chunk=0", "model.loss_chunk"), ("model.z_loss=-1", "model.z_loss"),
    ("model.loss=fused", "model.loss"), ("ac=some", "ac"), ("resume=nowhere/run", "resume=nowhere/run"),
    ("+model.n_layers=12", "model.n_layers"), ("++model.n_layers=12", "did you mean model.n_layer"),
    ("+nosuchkey=1", "nosuchkey"), ("~model.n_layer", "~model.n_layer"), ("~attn", "~attn"),
    ("~seq_len", "~seq_len"), ("seed=99999999999999999999", "seed"), ("hydra.run.dir=", "hydra.run.dir"),
    ("--bogus", "--bogus"), ("-m seq_len=64", "flags -m, --cfg, ... go before the overrides"),
    ("seq_len=${nothere}", "seq_len=${nothere}: interpolation key 'nothere' not found"),
    ("wandb.name=${nothere}", "wandb.name=${nothere}"),
    ("hydra.run.dir=/x/${oc.env:FLASH_GPT_UNSET}", "environment variable 'FLASH_GPT_UNSET' not found"),
    ("batch_size=100000000", "batch_size=100000000: with seq_len 32, a micro-step of 3,200,000,000 tokens needs"),
    ("attn.window=32", "attn.window=32: must be below seq_len 32"),
    ("attn.backend=cudnn", "attn.backend"), ("attn=sdpa attn.backend=triton", "attn.backend=triton: chooses which"),
    ("attn=triton attn.backend=gluon", "attn.backend=gluon: the Hopper kernels cannot run here"),
]


@pytest.mark.parametrize("overrides, key", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_a_bad_value_exits_2_with_one_line_naming_the_key_and_creates_nothing(overrides, key, tmp_path,
                                                                            monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the run dir (outputs/...) would be made
    with pytest.raises(SystemExit) as exit_:
        preflight.preflight([*TINY, *overrides.split()])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sweep, key", [("seq_len=32,abc", "seq_len=abc"), ("model.n_layers=1,2", "model.n_layers"),
                                        ("optim.lr=1e-3,-1", "optim.lr")])
def test_a_sweep_with_a_value_that_cannot_compose_is_one_line_and_makes_no_sweep_dir(sweep, key, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if key == "optim.lr":  # composes: a job whose value fails validation is skipped with its reason at run time
        claimed = [a.split("=")[0] for a in preflight.preflight(["-m", *TINY, sweep])]
        assert claimed == ["hydra.sweep.dir", "hydra.output_subdir"]  # each job writes its own record
        return
    with pytest.raises(SystemExit) as exit_:
        preflight.preflight(["-m", *TINY, sweep])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and key in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_says_it_in_one_line_too(data_root, tmp_path):
    done = run(command(data_root, "optim.beta2=1.5"), tmp_path)
    assert done.returncode == 2 and stderr_line(done) == "error: optim.beta2=1.5: must be in [0, 1)"
    assert list(tmp_path.iterdir()) == []


def test_a_flag_after_the_overrides_runs_as_typed(data_root, tmp_path):
    done = run(command(data_root, "max_steps=1", "seq_len=16", "-m"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert read_metrics(sweep / "0_sdpa_T16" / "summary.json")[0]["status"] == "ok"


@pytest.mark.slow
def test_a_batch_too_big_for_the_cpus_memory_is_one_line(data_root, tmp_path):
    # a bound no batch beats is refused before anything is made (BAD_VALUES); past it, the run's memory
    # is capped at what the machine has (here a 4 GiB limit stands for it): the first step fails to
    # allocate and says so in one line, where the kernel's OOM killer would end it without a word
    run_dir = tmp_path / "run"
    cmd = command(data_root, "batch_size=100000", "wandb.mode=offline", f"hydra.run.dir={run_dir}")
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=ENV,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, resource.RLIM_INFINITY)))
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == (
        "out of CPU memory at step 1 with attn=sdpa seq_len=32 batch_size=100000: lower batch_size or seq_len"), \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert read_metrics(run_dir / "summary.json")[0]["status"] == "oom"
    assert ending(wandb_file(run_dir)) == {"exit_code": 1, "preempting": False}


def test_a_home_that_cannot_be_written_is_one_line(data_root, tmp_path):
    home = tmp_path / "home"
    home.write_text("a file where a directory should be: no one can write under it")
    tools = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "MPLCONFIGDIR", "TRITON_HOME", "WANDB_CONFIG_DIR",
             "WANDB_CACHE_DIR", "WANDB_DATA_DIR")  # as a user without any of them set has it
    env = {k: v for k, v in ENV.items() if k not in tools} | {"HOME": str(home)}
    done = subprocess.run(command(data_root, "max_steps=2", "wandb.mode=offline", f"hydra.run.dir={tmp_path / 'run'}"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = [line for line in done.stderr.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith(("[20", "wandb: ")) and "|" not in line]
    assert len(ours) == 1 and ours[0].startswith(f"train.py: HOME ({home}) cannot be written: W&B, matplotlib, Triton "
                                                 "and Hugging Face keep their caches and settings in "), ours


def test_a_comma_in_a_path_is_taken_as_typed(data_root, tmp_path):
    run_dir = tmp_path / "a,b"
    done = run(command(data_root, f"hydra.run.dir={run_dir}", "max_steps=1"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_metrics(run_dir / "summary.json")[0]["status"] == "ok"


def test_a_comma_that_cannot_be_taken_as_typed_says_how_to_quote_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sweep_dir = f"{tmp_path}/a,b"
    cases = {("seq_len=64,128",): "seq_len=64,128: a comma separates the values of a sweep: add -m to run one job "
                                  "per value, or quote the value to keep its comma: 'seq_len=\"64,128\"'",
             ("-m", f"hydra.sweep.dir={sweep_dir}"): f"hydra.sweep.dir={sweep_dir}: Hydra's own keys take one value, "
                                                     "and in a sweep (-m) a comma separates values: quote the value "
                                                     f"to keep its comma: 'hydra.sweep.dir=\"{sweep_dir}\"'"}
    for argv, said in cases.items():
        with pytest.raises(SystemExit) as exit_:
            preflight.preflight(quoted_where_needed([*argv, *TINY], TrainConfig))
        assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {said}"]
    assert list(tmp_path.iterdir()) == []
    # the quoting it gives, as a shell passes it on, keeps the comma in the sweep dir
    advised = shlex.split(said.rsplit("keep its comma: ", 1)[1])
    assert preflight.preflight(["-m", *TINY, *advised]) == ["hydra.output_subdir=null"]


def test_an_online_dataset_without_the_hub_is_one_line_and_leaves_nothing(tmp_path):
    done = run([sys.executable, str(REPO / "train.py"), *TINY, "data=tinystories", f"data.root={tmp_path / 'data'}"],
               tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    line = stderr_line_after_logging(done)
    assert "cannot reach" in line and "python scripts/prepare_data.py tinystories" in line
    assert not (tmp_path / "data" / "tinystories").exists() and not list(tmp_path.glob("outputs/*/*"))


def stderr_line_after_logging(proc: subprocess.CompletedProcess) -> str:
    """The error line; Hydra's log lines (timestamped) may come before it."""
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("[20")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
def test_a_sweep_records_why_it_skipped_a_job(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    done = run([sys.executable, str(REPO / "train.py"), "-m", *BASE, f"data.root={data_root}", "max_steps=2",
                "model.n_head=2,3", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = read_metrics(sweep / "1_sdpa_T32" / "summary.json")[0]
    assert skipped["status"] == "skipped" and "model.d_model=32" in skipped["message"]
    table = run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(sweep)], tmp_path).stdout
    assert "skipped: model.d_model=32: must be divisible by model.n_head 3" in table


def test_metrics_are_strict_json_and_survive_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json_line({"step": 1, "loss": float("nan"), "grad_norm": float("inf")}) + '{"step": 2, "lo')
    assert path.read_text().startswith('{"step": 1, "loss": null, "grad_norm": null}\n')
    assert read_metrics(path) == [{"step": 1, "loss": None, "grad_norm": None}]
