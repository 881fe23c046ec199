"""A sweep's jobs (train.py -m): where each starts, and the record of one that cannot run.

A job continues its own dir: skipped where an earlier run of the sweep finished it, resumed from
the checkpoint there, or started fresh. A job whose config cannot run is recorded as skipped, with
its reason, in its own dir only, and the sweep goes on.
"""

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.files import WriteError, atomic_write
from trainer.checkpoint import CHECKPOINT_NAME
from trainer.metrics import json_line
from trainer.rundir import claim_run_dir, finished_summary, holds, write_record


def start_sweep_job(cfg: DictConfig, job_dir: Path) -> dict | None:
    """Where a sweep job starts. Its summary.json if an earlier run of the sweep finished it (it is
    skipped); else it continues its own dir: from the checkpoint there (resume=), or fresh, with
    Hydra's record of the command (.hydra/, which preflight turned off) written once the dir is
    this process's: never over the record of another run, live or finished."""
    done = finished_summary(job_dir)
    if done is not None and done["steps"] >= cfg.max_steps:
        return done
    if (job_dir / CHECKPOINT_NAME).exists():
        cfg.resume = str(job_dir)  # setup() claims the dir; its record stays that of the run that wrote the checkpoint
        return None
    claim_run_dir(job_dir, fresh=True)
    write_record(job_dir, cfg, HydraConfig.instance().cfg)
    return None


def record_skipped(job_dir: Path, e: Exception) -> None:
    """Says why the job cannot run, and records it as skipped in its own dir (where this process
    holds the dir and no run wrote a summary or checkpoint there)."""
    print(f"error: {e} (this job is skipped; the sweep goes on)", file=sys.stderr)
    if holds(job_dir) and not any((job_dir / name).exists() for name in ("summary.json", CHECKPOINT_NAME)):
        try:
            atomic_write(job_dir / "summary.json", json_line({"status": "skipped", "message": str(e)}).encode())
        except WriteError as write:
            print(f"error: {write}", file=sys.stderr)
