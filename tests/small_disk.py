"""Runs commands on a small disk and reports what they left there (tests/test_full_disk.py drives it).

Run in a private mount namespace where DISK is a fresh tmpfs that only it sees, and print one JSON
object: each command's exit code and stderr, then what RUN_DIR holds (its files, metrics.jsonl's
text, summary.json, how W&B closed its offline run).
    unshare -rm sh -c 'mount -t tmpfs -o size=SIZE tmpfs DISK && exec python tests/small_disk.py SPEC'
SPEC (JSON): {"disk": DISK, "run_dir": RUN_DIR, "runs": [{"cmd": [...], "fill": null | {"at": AT,
"leave": BYTES}, "unfill": bool}, ...]}. A fill writes DISK/filler until BYTES are left free: before
the command (AT "start"), once metrics.jsonl holds a step >= N (AT "step N"), or once RUN_DIR holds
a file (AT "file NAME"). "unfill" removes the filler after the command.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.wandb_records import ending  # noqa: E402
from trainer.metrics import read_metrics  # noqa: E402


def fill(disk: Path, leave: int) -> None:
    with open(disk / "filler", "ab", buffering=0) as f:
        while (free := os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize) > leave:
            try:
                f.write(bytes(min(free - leave, 1 << 20)))
            except OSError:  # the last page would not fit
                return


def due(at: str, run_dir: Path) -> bool:
    what, _, arg = at.partition(" ")
    if what == "step":
        return any(r.get("step", 0) >= int(arg) for r in read_metrics(run_dir / "metrics.jsonl"))
    return (run_dir / arg).exists()


def run(disk: Path, run_dir: Path, cmd: list[str], fill_spec: dict | None) -> dict:
    if fill_spec and fill_spec["at"] == "start":
        fill(disk, fill_spec["leave"])
        fill_spec = None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if fill_spec:
        deadline = time.monotonic() + 600
        while not due(fill_spec["at"], run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        fill(disk, fill_spec["leave"])
    stderr = proc.communicate(timeout=600)[1]
    return {"rc": proc.returncode, "stderr": stderr}


def main() -> None:
    spec = json.loads(sys.argv[1])
    disk, run_dir = Path(spec["disk"]), Path(spec["run_dir"])
    report = {"runs": []}
    for r in spec["runs"]:
        report["runs"].append(run(disk, run_dir, r["cmd"], r.get("fill")))
        if r.get("unfill"):
            (disk / "filler").unlink()
    exists = run_dir.is_dir()
    report["files"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) if exists else None
    metrics, summary = run_dir / "metrics.jsonl", run_dir / "summary.json"
    report["metrics"] = metrics.read_text() if metrics.exists() else None
    report["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    runs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")) if exists else []
    try:
        report["wandb"] = ending(runs[-1]) if runs else None
    except AssertionError as e:  # the run's file holds no exit record
        report["wandb"] = str(e)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
