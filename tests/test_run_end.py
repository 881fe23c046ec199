"""The end of a run, as a newcomer sees it: real tiny CPU runs of train.py.

- every run ends with curves.png (a PNG that opens) and a summary of at most eight short lines:
  losses, tokens/s, peak RSS on the CPU, the run dir, the checkpoint, and commands that work as
  printed: the sample command samples, the resume command of a stopped run finishes it, and its
  curves.png is drawn again over every step;
- on the CPU, metrics rows and summary.json hold the process's peak RSS;
- a run without checkpoints says so, and a curves.png that cannot be written is one line that
  loses neither the summary nor the checkpoint;
- scripts/sweep_summary.py overlays runs from outputs/, each labelled by the settings they differ in.

    .venv/bin/python -m pytest tests/test_run_end.py -q
"""

import csv
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest

import train as train_module
from scripts.sweep_summary import read_sweep
from tests.helpers import REPO, TINY, compose, metrics
from trainer.checkpoint import load_checkpoint

BASE = [*TINY, "log_interval=1", "eval_interval=2", "wandb.mode=disabled"]


def summary_block(stdout: str) -> list[str]:
    """The closing lines: the last thing a run prints on stdout, from its status line on."""
    lines = stdout.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.split(":")[0] in ("ok", "stopped", "failed"))
    return lines[start:]


def said(block: list[str], key: str) -> str:
    (line,) = [line for line in block if line.startswith(f"{key}: ")]
    return line.removeprefix(f"{key}: ")


def in_shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """A printed command pasted into a shell in the directory the run ran in. It names the
    interpreter that ran the run (from elsewhere than the repository, by its absolute path)."""
    assert Path(cwd, shlex.split(command)[0]).absolute() == Path(sys.executable).absolute(), command
    return subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape[:2] > (300, 1000)  # it decodes: three panels side by side


@pytest.fixture(scope="module")
def outputs(data_root, tmp_path_factory) -> Path:
    """A working dir in which train.py ran twice into its default outputs/<date>/<time>_<attn>_T32
    dirs, naive then sdpa; each run's stdout beside its dir."""
    cwd = tmp_path_factory.mktemp("cwd")
    for attn in ("naive", "sdpa"):
        done = subprocess.run([sys.executable, str(REPO / "train.py"), *BASE, f"attn={attn}", f"data.root={data_root}",
                               "max_steps=4"], cwd=cwd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        (run_dir,) = cwd.glob(f"outputs/*/*_{attn}_T32")
        (run_dir.parent / f"{attn}.stdout").write_text(done.stdout)
    return cwd


@pytest.mark.slow
def test_a_finished_run_ends_with_curves_and_eight_short_lines(outputs):
    (run_dir,) = outputs.glob("outputs/*/*_sdpa_T32")
    block = summary_block((run_dir.parent / "sdpa.stdout").read_text())
    assert len(block) <= 8, block
    commands = [said(block, key) for key in ("sample", "train further")]
    assert all(len(line) <= 100 for line in block if line.split(":")[0] not in ("sample", "train further")), block
    assert block[0].startswith("ok: 4 steps, val loss ") and "train loss " in block[0]
    assert said(block, "memory").startswith("peak RSS ") and said(block, "memory").endswith(" GiB (CPU)")
    shown = run_dir.relative_to(outputs)
    assert said(block, "run dir") == f"{shown} (curves.png, metrics.jsonl, summary.json)"
    assert said(block, "checkpoint") == f"{shown / 'ckpt.pt'} (step 4)"
    assert_png(run_dir / "curves.png")
    # the CPU's memory: the process's peak RSS, in every training record and in summary.json
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert len(rows) == 4 and all(r["peak_rss_gib"] > 0 and r["peak_mem_alloc_gib"] is None for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_rss_gib"] == max(r["peak_rss_gib"] for r in rows) and summary["peak_mem_alloc_gib"] is None
    assert summary["final_loss"] == rows[-1]["loss"]
    # the sample command samples from the checkpoint as printed; train further resumes to max_steps=8
    done = in_shell(commands[0] + " max_new_tokens=3 device=cpu", outputs, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ROMEO:"), done.stderr[-2000:]
    assert "max_steps=8 resume=" + str(shown) in commands[1]


@pytest.mark.slow
def test_a_stopped_run_ends_with_curves_and_its_resume_command_finishes_it(data_root, tmp_path):
    run_dir = tmp_path / "run"
    # far more steps than the stop needs: a poller held up on a busy machine still stops the run mid-way
    cmd = [sys.executable, str(REPO / "train.py"), *BASE, f"data.root={data_root}", "max_steps=60",
           f"hydra.run.dir={run_dir}"]
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not any(r.get("step", 0) >= 2 for r in metrics(run_dir)) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step 2 in 600 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 143, stderr[-2000:]
    block = summary_block((tmp_path / "out").read_text())
    step = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert len(block) <= 8 and block[0].startswith(f"stopped: {step} steps"), block
    assert said(block, "checkpoint") == f"run/ckpt.pt (step {step})"  # relative to the working dir
    stopped_curves = (run_dir / "curves.png").read_bytes()
    assert_png(run_dir / "curves.png")
    done = in_shell(said(block, "resume"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary_block(done.stdout)[0].startswith("ok: 60 steps")
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == list(range(1, 61))
    assert (run_dir / "curves.png").read_bytes() != stopped_curves  # drawn again, over all 60 steps
    assert_png(run_dir / "curves.png")


def test_a_run_without_checkpoints_says_so(data_root, tmp_path, capsys):
    cfg = compose(BASE + [f"data.root={data_root}", "max_steps=2", "ckpt_interval=-1"])
    summary = train_module.train(cfg, tmp_path)
    block = summary_block(capsys.readouterr().out)
    assert summary["status"] == "ok" and len(block) == 5, block  # outcome, speed, memory, run dir, checkpoint
    assert said(block, "checkpoint") == "none (ckpt_interval=-1)" and not (tmp_path / "ckpt.pt").exists()
    assert_png(tmp_path / "curves.png")


def test_curves_that_cannot_be_written_lose_neither_summary_nor_checkpoint(data_root, tmp_path, capsys):
    (tmp_path / "curves.png").mkdir()  # in the way of the file: the rename over it fails
    summary = train_module.train(compose(BASE + [f"data.root={data_root}", "max_steps=2"]), tmp_path)
    out, err = capsys.readouterr()
    assert summary["status"] == "ok"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 2
    (line,) = [line for line in err.splitlines() if "curves.png" in line]
    assert line.startswith(f"error: {tmp_path / 'curves.png'} cannot be written: Is a directory ("), line
    block = summary_block(out)
    assert said(block, "run dir") == f"{tmp_path} (metrics.jsonl, summary.json)"
    # outside train.py's own command line (a script's runs, in its process) no command continues the run
    assert not [line for line in block if line.startswith("train further")], block


@pytest.mark.slow
def test_runs_from_outputs_are_compared_on_one_plot(outputs):
    runs = sorted(outputs.glob("outputs/*/*_T32"))
    out = outputs / "compare"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), *map(str, runs), "--out",
                           str(out)], cwd=outputs, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["attn"], r["status"], r["steps"]) for r in rows] == [("naive", "ok", "4"), ("sdpa", "ok", "4")]
    assert all(float(r["peak_rss_gib"]) > 0 for r in rows)
    assert (out / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["label"] for r in read_sweep(*runs)] == ["attn=naive", "attn=sdpa"]  # the lines' labels
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), *map(str, runs)],
                             cwd=outputs, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.startswith("error: 2 directories and no --out")
