"""A full disk anywhere is one line, and no file it touched is left torn: real small filesystems.

Each train.py case runs on a tmpfs that only its own mount namespace sees (unshare -rm; skipped
where the machine allows neither), through tests/small_disk.py, with real offline W&B runs:
- the disk fills while the run trains (another process takes the space): the run stops after the
  step in flight in one line, metrics.jsonl holds whole lines, summary.json says why;
- the run fills its disk itself: it stops while RESERVE is still free, and W&B (which drops what
  does not fit without a word) closes its run whole;
- no room at the start: one line, exit 2, no run dir (Hydra has written nothing);
- the disk is full when summary.json is written: one line, exit 1, and resume= finishes the run
  once there is room;
- a script's output that does not fit is one line, exit 1, and no file half-written;
- a JSON-lines append that does not fit leaves the file as it was; a line cut by a kill is
  dropped before the next one is appended.

    .venv/bin/python -m pytest tests/test_full_disk.py -q      # about two minutes on 2 cores
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.files import append_line
from tests.helpers import REPO, TINY, private_tmpfs_works
from trainer.metrics import read_metrics
from trainer.rundir import RESERVE

pytestmark = pytest.mark.skipif(not private_tmpfs_works(),
                                reason="needs unshare -rm and tmpfs mounts for a private small disk")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def on_small_disk(tmp_path: Path, runs: list[dict], size: str = "16m") -> dict:
    """tests/small_disk.py's report of `runs` on a fresh tmpfs of `size` at tmp_path/disk; the run
    dir is tmp_path/disk/run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    spec = {"disk": str(disk), "run_dir": str(disk / "run"), "runs": runs}
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && exec "$3" tests/small_disk.py "$4"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", size, str(disk), sys.executable,
                           json.dumps(spec)], cwd=REPO, capture_output=True, text=True, timeout=1200, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(data_root: str, tmp_path: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *TINY, f"data.root={data_root}", "log_interval=1",
            "eval_interval=0", "wandb.mode=offline", f"hydra.run.dir={tmp_path / 'disk' / 'run'}", *overrides]


def the_line(stderr: str, words: str) -> str:
    """The one line of stderr holding `words`; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if words in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def assert_whole_lines(text: str) -> list[dict]:
    assert text.endswith("\n"), text[-300:]
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.slow
def test_a_disk_that_fills_while_the_run_trains_stops_it_in_one_line(data_root, tmp_path):
    report = on_small_disk(tmp_path, [{"cmd": train(data_root, tmp_path, "ckpt_interval=-1", "max_steps=100000"),
                                       "fill": {"at": "step 3", "leave": 20 * 1024}}])
    run = report["runs"][0]
    assert run["rc"] == 1
    line = the_line(run["stderr"], "disk nearly full")
    assert "no checkpoint was written" in line
    records = assert_whole_lines(report["metrics"])
    assert records[-1]["event"] == "failed" and records[-2]["step"] >= 3
    assert report["summary"]["status"] == "failed" and "disk nearly full" in report["summary"]["message"]


@pytest.mark.slow
def test_a_run_that_fills_its_disk_stops_with_room_to_close_its_records(data_root, tmp_path):
    report = on_small_disk(tmp_path, [{"cmd": train(data_root, tmp_path, "ckpt_interval=-1", "max_steps=100000"),
                                       "fill": {"at": "start", "leave": RESERVE + 128 * 1024}}])
    run = report["runs"][0]
    assert run["rc"] == 1
    the_line(run["stderr"], "disk nearly full")
    assert_whole_lines(report["metrics"])
    assert report["summary"]["status"] == "failed"
    assert report["wandb"] == {"exit_code": 1, "preempting": False}  # W&B's run whole, to its exit record


def test_a_disk_without_room_at_the_start_is_one_line_and_no_run_dir(data_root, tmp_path):
    report = on_small_disk(tmp_path, [{"cmd": train(data_root, tmp_path), "fill": {"at": "start", "leave": 0}}])
    run = report["runs"][0]
    assert run["rc"] == 2
    assert the_line(run["stderr"], "error:").endswith(f"bytes free, a run needs {RESERVE:,} for its records: free "
                                                      "some space or choose another hydra.run.dir")
    assert report["files"] is None


@pytest.mark.slow
def test_a_summary_that_does_not_fit_is_one_line_and_resume_writes_it(data_root, tmp_path):
    # the disk (room for a ~20 MB checkpoint) fills once the last checkpoint is written, while the
    # sample is generated
    cmd = train(data_root, tmp_path, "ckpt_interval=0", "max_steps=4", "sample_tokens=3000")
    report = on_small_disk(tmp_path, [{"cmd": cmd, "fill": {"at": "file ckpt.pt", "leave": 0}, "unfill": True},
                                      {"cmd": cmd + [f"resume={tmp_path / 'disk' / 'run'}"]}], size="64m")
    first, resumed = report["runs"]
    assert first["rc"] == 1, first["stderr"][-3000:]
    line = the_line(first["stderr"], "summary.json")
    assert line.startswith("error: disk full while writing") and f"add resume={tmp_path / 'disk' / 'run'}" in line
    assert resumed["rc"] == 0, resumed["stderr"][-3000:]
    assert report["summary"]["status"] == "ok" and report["summary"]["steps"] == 4 and report["summary"]["sample"]
    records = assert_whole_lines(report["metrics"])
    assert report["summary"]["final_loss"] == [r["loss"] for r in records if "loss" in r][-1]
    assert report["wandb"] == {"exit_code": 0, "preempting": False}


def test_a_script_whose_output_does_not_fit_says_so_in_one_line(tmp_path):
    out = tmp_path / "disk" / "run"  # the driver lists what is left in there
    cmd = [sys.executable, str(REPO / "scripts" / "long_context.py"), "--from-csv",
           str(REPO / "docs" / "long_context" / "long_context.csv"), "--out", str(out), "--title", "a full disk"]
    report = on_small_disk(tmp_path, [{"cmd": cmd, "fill": {"at": "start", "leave": 0}}], size="1m")
    run = report["runs"][0]
    assert run["rc"] == 1
    assert the_line(run["stderr"], "error:") == (f"error: disk full while writing {out / 'long_context.md'} (temp file "
                                                 "removed; nothing written)")
    assert report["files"] == []


def test_an_append_that_does_not_fit_leaves_the_file_as_it_was(tmp_path):
    # the file's page has room for part of the line: a plain append would leave it cut there
    path = tmp_path / "disk" / "run" / "metrics.jsonl"
    code = ("import sys; from pathlib import Path; from data.files import append_line, DiskFullError\n"
            f"path = Path({str(path)!r}); path.parent.mkdir()\n"
            "append_line(path, '{\"step\": 1}\\n')\n"
            "with open(path.parent.parent / 'filler', 'wb', buffering=0) as f:\n"
            "    try:\n"
            "        while True: f.write(bytes(1 << 16))\n"
            "    except OSError: pass\n"
            "append_line(path, '{\"step\": 2, \"note\": \"' + 'x' * 10000 + '\"}\\n')\n")
    report = on_small_disk(tmp_path, [{"cmd": [sys.executable, "-c", code]}], size="1m")
    run = report["runs"][0]
    assert run["rc"] == 1
    said = run["stderr"].strip().splitlines()[-1]
    assert said == f"data.files.DiskFullError: disk full while writing {path} (the file is as it was)", said
    assert report["metrics"] == '{"step": 1}\n'


def test_an_append_after_a_line_cut_by_a_kill_drops_that_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # as a kill -9 in the middle of an append leaves it
    append_line(path, '{"step": 2, "loss": 1.5}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2, "loss": 1.5}\n'
    assert read_metrics(path) == [{"step": 1}, {"step": 2, "loss": 1.5}]
