"""A stop at every phase of train.py ends with its one line, its exit code and the files that phase
promises: real train.py processes, real signals, each sent the moment the phase is seen.

- Ctrl-C while train.py or sample.py import their libraries: one line, exit 130, no traceback;
- SIGTERM the moment the run dir is claimed: one line, exit 143, the dir given up;
- SIGTERM between a sweep's jobs: the sweep stops at once, in one line that gives the command that
  continues it, and that command finishes the sweep;
- SIGTERM or Ctrl-C during the end-of-run sample: the sample is given up, the run's summary.json
  (status ok), curves.png and W&B's close are written, one line, 128 + the signal; in a sweep,
  the sweep stops there;
- Ctrl-C in the middle of a checkpoint's torch.save: the interruption's line (not a full disk),
  the temp file gone, summary.json and curves.png written;
- SIGTERM, then Ctrl-C while the stop's checkpoint is written: the checkpoint is whole, the line is
  the SIGTERM's, summary.json and curves.png are written.

    .venv/bin/python -m pytest tests/test_stop_phases.py -q      # about two minutes on 2 cores
"""

import json
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, catches, metrics, start, wandb_file, wait_for
from tests.wandb_records import ending
from trainer.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train.py")
BASE = [*TINY, "log_interval=1", "eval_interval=0"]
# a model whose checkpoint takes a second to write (32M parameters and their AdamW state)
BIG = ["model.n_layer=2", "model.n_head=8", "model.d_model=512"]


def ended(proc, cwd: Path, code: int) -> list[str]:
    """The lines of ours on stderr (not a progress bar's, nor Hydra's or W&B's logging), once the
    process has exited with `code`; never a traceback."""
    proc.wait(timeout=600)
    err = (cwd / "err.log").read_text()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith(("[20", "wandb:")) and "|" not in line]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def saving(run_dir: Path) -> bool:
    return run_dir.exists() and any(p.name.startswith(".ckpt.pt.") for p in run_dir.iterdir())


@pytest.mark.parametrize("script", ["train.py", "scripts/sample.py"])
def test_ctrl_c_while_a_program_imports_is_one_line(script, tmp_path):
    proc = start([str(REPO / script), f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    # SIGTERM caught: trainer/startup.py's handlers are in place, and torch takes seconds to import after
    wait_for(proc, tmp_path, lambda: catches(proc.pid, signal.SIGTERM), "the start-up handlers")
    proc.send_signal(signal.SIGINT)
    lines = ended(proc, tmp_path, 130)
    assert lines == [f"{Path(script).name}: stopped by SIGINT while starting; nothing was done"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["err.log", "out.log"]


def test_sigterm_the_moment_the_run_dir_is_claimed_gives_it_up(data_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([TRAIN, *BASE, f"data.root={data_root}", f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(proc, tmp_path, lambda: (run_dir / ".lock").exists(), "the run dir's lock")
    proc.send_signal(signal.SIGTERM)
    lines = ended(proc, tmp_path, 143)
    assert lines == ["stopped by SIGTERM before the first step; nothing was saved: the same command starts the run "
                     "again"]
    assert not run_dir.exists()


def test_sigterm_between_sweep_jobs_stops_the_sweep_and_its_command_finishes_it(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    args = [TRAIN, "-m", *BASE, f"data.root={data_root}", "max_steps=2", "seq_len=16,32", f"hydra.sweep.dir={sweep}"]
    proc = start(args, tmp_path)
    wait_for(proc, tmp_path, lambda: (sweep / "0_sdpa_T16" / "summary.json").exists(), "the first job's end")
    proc.send_signal(signal.SIGTERM)
    lines = ended(proc, tmp_path, 143)
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM") and "continues the sweep" in lines[0], lines
    # as the first job closed, or before the second's first step: no dir is left holding only bookkeeping
    assert [p.name for p in sweep.iterdir() if p.is_dir()] == ["0_sdpa_T16"]
    assert summary(sweep / "0_sdpa_T16")["status"] == "ok"
    command = shlex.split(re.search(r": (\S*python\S* .*) continues the sweep", lines[0])[1])
    assert command[0] == sys.executable, command  # run as printed: this interpreter, by its path
    again = start(command[1:], tmp_path)
    assert any(line.startswith("0_sdpa_T16: skipped: its run finished at step 2") for line in ended(again, tmp_path, 0))
    assert summary(sweep / "1_sdpa_T32")["status"] == "ok"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_during_the_end_of_run_sample_gives_up_the_sample_alone(sig, data_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([TRAIN, *BASE, f"data.root={data_root}", "max_steps=3", "sample_tokens=1000000",
                  "wandb.mode=offline", f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(proc, tmp_path, lambda: "sample:" in (tmp_path / "err.log").read_text(), "the sample's progress bar")
    proc.send_signal(sig)
    lines = ended(proc, tmp_path, 128 + sig)
    assert lines[-1] == (f"stopped by {sig.name} as the run closed: the end-of-run sample was given up; it finished "
                         "at step 3 and its files are written")
    done = summary(run_dir)
    assert done["status"] == "ok" and done["steps"] == 3 and "sample" not in done
    assert (run_dir / "curves.png").stat().st_size > 0
    assert load_checkpoint(run_dir / "ckpt.pt")["step"] == 3
    assert ending(wandb_file(run_dir)) == {"exit_code": 0, "preempting": False}


def test_sigterm_during_a_sweep_jobs_sample_stops_the_sweep_there(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    proc = start([TRAIN, "-m", *BASE, f"data.root={data_root}", "max_steps=2", "sample_tokens=1000000",
                  "seq_len=16,32", f"hydra.sweep.dir={sweep}"], tmp_path)
    wait_for(proc, tmp_path, lambda: "sample:" in (tmp_path / "err.log").read_text(), "the first job's sample")
    proc.send_signal(signal.SIGTERM)
    lines = ended(proc, tmp_path, 143)
    assert "the end-of-run sample was given up" in lines[-1] and "continues the sweep" in lines[-1], lines
    assert summary(sweep / "0_sdpa_T16")["status"] == "ok"
    assert not (sweep / "1_sdpa_T32").exists()


def test_ctrl_c_inside_a_checkpoints_torch_save_is_an_interruption_not_a_full_disk(data_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([TRAIN, *BASE, *BIG, f"data.root={data_root}", "max_steps=100", "ckpt_interval=2",
                  f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(proc, tmp_path, lambda: saving(run_dir), "the first checkpoint's write")
    proc.send_signal(signal.SIGINT)
    lines = ended(proc, tmp_path, 130)
    assert lines[-1].startswith("interrupted at step 2; no checkpoint was written: add resume="), lines
    assert not any("disk full" in line for line in lines)
    assert not saving(run_dir) and not (run_dir / "ckpt.pt").exists()
    assert summary(run_dir)["status"] == "stopped" and (run_dir / "curves.png").exists()


def test_sigterm_then_ctrl_c_while_the_stops_checkpoint_is_written(data_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([TRAIN, *BASE, *BIG, f"data.root={data_root}", "max_steps=100", "ckpt_interval=0",
                  f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(proc, tmp_path, lambda: len(metrics(run_dir)) >= 1, "the first step")
    proc.send_signal(signal.SIGTERM)
    wait_for(proc, tmp_path, lambda: saving(run_dir), "the stop's checkpoint")
    proc.send_signal(signal.SIGINT)
    lines = ended(proc, tmp_path, 143)
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert lines[-1].startswith(f"stopped by SIGTERM after step {step}; the last checkpoint (step {step})"), lines
    assert summary(run_dir)["status"] == "stopped" and (run_dir / "curves.png").exists()
