"""What a run reports, and where: tokens/s, MFU and peak memory per log interval (Meter), written to
metrics.jsonl and the W&B run (RunLog) by rank 0. Peak memory on CUDA is the allocator's peak
allocated and reserved GiB of the interval; on the CPU, which has no such counters, the process's
peak resident set (peak_rss_gib) since it started, which only grows.

W&B runs in the mode configs/runtime.py resolves (wandb.mode, else WANDB_MODE, else offline); an
online run that has no API key or cannot reach W&B says why in one line and logs offline instead.
"""

import contextlib
import errno
import math
import resource
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from configs.runtime import wandb_mode, wandb_online_problem
from configs.schema import plain
from data.files import DiskFullError, append_line, atomic_write, free_bytes
from trainer.metrics import json_line, read_metrics, steady
from trainer.rundir import RESERVE

# dense bf16 tensor-core peak by datasheet, for MFU; substrings of torch.cuda.get_device_name()
GPU_PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12,
                       "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12,
                       "RTX 4090": 165e12, "RTX 3090": 71e12}


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16_FLOPS.items() if key in name), None)


class Meter:
    """Tokens/s, MFU and peak memory between log points, and the history of logged records."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, device: torch.device, world: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.device, self.world = device, world
        self.peak_flops = gpu_peak_flops(device)
        self.history: list[dict] = []
        self.peaks = {"peak_mem_alloc_gib": None, "peak_mem_reserved_gib": None}  # GPU only
        if device.type != "cuda":
            self.peaks["peak_rss_gib"] = None
        self.restart()

    def restart(self) -> None:
        """Starts a throughput interval: after setup and after each record."""
        self.t0, self.tokens = time.perf_counter(), 0

    def count_step(self) -> None:
        self.tokens += self.tokens_per_step

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpointing inside are not training time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the queued training work is training time
        start = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - start

    def record(self, **values) -> dict:
        """The record of the interval since the last one; the caller has synced the device."""
        tok_s = self.tokens / (time.perf_counter() - self.t0)
        rec = {**values, "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / self.world,
               "mfu": self.flops_per_token * tok_s / (self.peak_flops * self.world) if self.peak_flops else None,
               **self._memory()}
        self.restore([rec])
        self.restart()
        return rec

    def restore(self, records: list[dict]) -> None:
        """Adds logged training records to the history and the peaks (a run resumed at its end reads them back)."""
        for rec in records:
            for k in self.peaks:
                if rec.get(k) is not None:
                    self.peaks[k] = max(self.peaks[k] or 0.0, rec[k])
            self.history.append(rec)

    def _memory(self) -> dict:
        """Peak allocated/reserved GiB since the previous record, None on the CPU; there the peak
        RSS of the process so far (max over ranks)."""
        if self.device.type == "cuda":
            peaks = torch.tensor([torch.cuda.max_memory_allocated(self.device),
                                  torch.cuda.max_memory_reserved(self.device)], dtype=torch.float64, device=self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:  # ru_maxrss is in KiB on Linux
            peaks = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        gib = (peaks / 2**30).tolist()
        if self.device.type == "cuda":
            return {"peak_mem_alloc_gib": gib[0], "peak_mem_reserved_gib": gib[1]}
        return {"peak_mem_alloc_gib": None, "peak_mem_reserved_gib": None, "peak_rss_gib": gib[0]}

    def summary(self) -> dict:
        records = steady(self.history)
        mfus = [r["mfu"] for r in records if r["mfu"] is not None]
        return {"mean_tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records) if records else None,
                "mean_mfu": sum(mfus) / len(mfus) if mfus else None, **self.peaks}


def outcome_lines(summary: dict) -> list[str]:
    """How a run went, in rounded numbers: its losses; its speed; its peak memory (the last two where logged)."""
    said = [f"{summary['steps']} steps"]
    if (val := summary["final_val_loss"]) is not None:
        best = summary["best_val_loss"]
        said.append(f"val loss {val:.3f}" + (f" (best {best:.3f})" if best is not None and best < val else ""))
    if summary["final_loss"] is not None:
        said.append(f"train loss {summary['final_loss']:.3f}")
    lines = [f"{summary['status']}: {', '.join(said)}"]
    if summary["mean_tokens_per_s"] is not None:
        mfu = summary["mean_mfu"]
        lines.append(f"speed: {summary['mean_tokens_per_s']:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu else ""))
    if summary["peak_mem_alloc_gib"] is not None:
        lines.append(f"memory: peak {summary['peak_mem_alloc_gib']:.2f} GiB allocated, "
                     f"{summary['peak_mem_reserved_gib']:.2f} GiB reserved (GPU)")
    elif summary.get("peak_rss_gib") is not None:
        lines.append(f"memory: peak RSS {summary['peak_rss_gib']:.2f} GiB (CPU)")
    return lines


class RunLog:
    """Rank 0's metrics sinks: metrics.jsonl in the run dir and the W&B run."""

    def __init__(self, run_dir: Path, cfg: DictConfig, wandb_id: str | None, resume_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # keep the curve single-valued: drop what the interrupted run logged past its checkpoint
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write(self.path, "".join(json_line(r) for r in kept).encode())
        group = cfg.wandb.group
        if group is None and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            group = "sweep-" + Path(HydraConfig.get().sweep.dir).as_posix().replace("/", "_")
        self.run = open_wandb(cfg, run_dir, group=group, config=plain(cfg), id=wandb_id,
                              name=cfg.wandb.name or f"{cfg.attn.name}-T{cfg.seq_len}-{cfg.model.name}",
                              resume="allow" if wandb_id else None)

    def log(self, record: dict, closing: bool = False) -> None:
        """Appends record to metrics.jsonl and the W&B run; DiskFullError, with nothing written, once
        the disk has less than RESERVE free, unless the record is the run's closing one."""
        if not closing and (free := free_bytes(self.path)) < RESERVE:
            raise DiskFullError(errno.ENOSPC, self.path, f"disk nearly full: {free:,} bytes free for "
                                f"{self.path.parent}, under the {RESERVE:,} a run keeps to close its records "
                                "(summary.json, W&B)")
        append_line(self.path, json_line(record))
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self.run.log(numbers, step=record["step"])

    def where(self) -> str | None:
        """Where the W&B run went: its page, or the command that uploads it; None where W&B is disabled."""
        if self.run.disabled:
            return None
        if self.run.offline:
            return f"offline; upload it with: wandb sync {shlex.quote(self.run.settings.sync_dir)}"
        return self.run.url

    def finish(self, summary: dict) -> None:
        """Closes the W&B run. On a full disk W&B drops what does not fit without a word, but its own
        log file in the run dir fails to close: that is one line, and the run's end goes on."""
        try:
            self.run.summary.update({k: v for k, v in summary.items() if k != "sample"})
            if summary["status"] == "stopped":  # W&B shows it as preempted, to be resumed
                self.run.mark_preempting()
            self.run.finish(exit_code=0 if summary["status"] == "ok" else 1)
        except OSError as e:
            print(f"error: W&B could not close its run in {self.path.parent / 'wandb'} ({e.strerror}): its last "
                  "records may be missing", file=sys.stderr)


class DisabledRun:
    """What is read of a W&B run where W&B is disabled: nothing is logged, and wandb is not imported
    (a machine without it trains with wandb.mode=disabled)."""
    disabled, offline, id, url = True, False, None, None

    def __init__(self):
        self.summary = {}
        self.config = self  # run.config.update(values, allow_val_change=True): kept nowhere

    def update(self, values: dict, allow_val_change: bool = False) -> None:
        pass

    def log(self, record: dict, step: int | None = None) -> None:
        pass

    def mark_preempting(self) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def open_wandb(cfg: DictConfig, run_dir: Path, **kwargs):
    """wandb.init in the mode cfg resolves to (configs/runtime.py): online where W&B can be reached
    with a key, else offline with one line saying why and how to upload the run later; disabled, a
    DisabledRun."""
    mode = wandb_mode(cfg.wandb.mode)
    if mode == "disabled":
        return DisabledRun()
    import wandb  # slow to import: only the processes that log pay for it

    if mode == "online" and (problem := wandb_online_problem()):
        print(f"wandb: {problem}; logging offline instead (upload it later: wandb sync "
              f"{shlex.quote(str(run_dir / 'wandb'))}/offline-run-*)", file=sys.stderr)
        mode = "offline"
    # quiet: no end-of-run block of sparklines (train.py prints its own summary); the run's files are the same
    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, tags=list(cfg.wandb.tags), mode=mode,
                      dir=str(run_dir), settings=wandb.Settings(quiet=True), **kwargs)
