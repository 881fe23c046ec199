"""The end of a run: summary.json, the sample, W&B closed, curves.png, and the few lines it prints
(how it went, where its files are, the commands that sample from it and continue it).
"""

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from configs.runtime import autocast
from data import document_ids, get_encoding
from data.files import WriteError, atomic_write
from model import GPT, get_attention
from trainer.checkpoint import CHECKPOINT_NAME
from trainer.commands import continue_command, resume_hint, sample_command, shown, started_here, sweeping
from trainer.curves import CURVES_NAME, write_curves
from trainer.metrics import json_line
from trainer.report import outcome_lines
from trainer.run import Run
from trainer.signals import Stopped


def finish(run: Run, status: str, message: str | None, check: Callable[[], None] = lambda: None) -> dict:
    """Writes summary.json and closes the W&B run (rank 0); returns the summary, whose message the
    caller says (main(): train.py's line; a script stopped or failed by it, its own). check() runs
    between the sample's tokens: a stop it raises gives the sample up, and the run closes without it."""
    cfg = run.cfg
    if message and run.master:
        with contextlib.suppress(WriteError):  # a full disk: the record may not fit, the summary's message says it
            run.log.log({"step": run.step, "event": status, status: 1, "message": message}, closing=True)
    history = run.meter.history
    summary = {"status": status, "message": message, "steps": run.step,
               "best_val_loss": run.best_val if run.last_val is not None else None, "final_val_loss": run.last_val,
               "final_loss": history[-1]["loss"] if history else None, **run.meter.summary(),
               "attn": str(cfg.attn.name), "seq_len": cfg.seq_len, **run.info}
    # sharded, every rank's forward gathers weights with the others: all sample, or none (a rank-0 save failed)
    ok = run.par.all_agree(status == "ok") if run.par.sharded else status == "ok"
    if ok and cfg.sample_tokens > 0 and (run.master or run.par.sharded):
        with contextlib.suppress(Stopped):  # a sharded sample is not given up alone: the ranks sample together
            summary["sample"] = sample(run.raw_model, cfg, run.device, cuda_graph=not run.par.sharded,
                                       check=(lambda: None) if run.par.sharded else check, progress=run.master)
    if run.master:
        if "sample" in summary:
            print(f"--- sample ---\n{summary['sample']}\n--------------")
        try:
            atomic_write(run.run_dir / "summary.json", json_line(summary).encode())
        except WriteError as e:  # not finished without it: resume= from its last checkpoint writes it
            line = f"error: {e}" + (f"; {resume_hint(run.run_dir)}" if run.saved_step == run.step else "")
            if status == "ok":  # now a failed run, whose message main() says
                summary.update(status="failed", message=line)
            else:  # main() says the stop's or the failure's own message
                print(line, file=sys.stderr)
        run.log.finish(summary)
        title = f"{run.run_dir.name}: attn={cfg.attn.name}, seq_len={cfg.seq_len}, model={cfg.model.name}"
        curves = write_curves(run.run_dir, f"{title} ({summary['status']} at step {run.step})")
        print("\n".join(closing_lines(run, summary, curves)), flush=True)
    run.par.close()
    return summary


def closing_lines(run: Run, summary: dict, curves: Path | None) -> list[str]:
    """The end of a run in at most eight short lines: how it went (trainer/report.py), where its
    files are, and the commands that sample from its checkpoint and continue it."""
    files = [CURVES_NAME] * bool(curves) + [name for name in ("metrics.jsonl", "summary.json")
                                            if (run.run_dir / name).exists()]
    lines = [*outcome_lines(summary), f"run dir: {shown(run.run_dir)} ({', '.join(files)})"]
    if run.saved_step is None:
        every = run.cfg.ckpt_interval
        lines.append("checkpoint: none (ckpt_interval=-1)" if every < 0 else
                     f"checkpoint: none yet (ckpt_interval={every}: the first at step {every or run.cfg.max_steps})")
    else:
        lines += [f"checkpoint: {shown(run.run_dir / CHECKPOINT_NAME)} (step {run.saved_step})",
                  f"sample: {sample_command(run.run_dir, run.cfg.sample_prompt)}"]
        if not started_here():
            pass  # a script's runs are its own business: the script says how to go on
        elif sweeping():
            if summary["status"] != "ok":
                lines.append(f"resume: {resume_hint(run.run_dir)}")
        elif summary["status"] == "ok":
            lines.append(f"train further: {continue_command(run.run_dir, run.par.world == 1, 2 * run.cfg.max_steps)}")
        else:
            lines.append(f"resume: {continue_command(run.run_dir, run.par.world == 1)}")
    if where := run.log.where():
        lines.append(f"W&B: {where}")
    return lines


def sample(model: GPT, cfg: DictConfig, device: torch.device, cuda_graph: bool = True,
           check: Callable[[], None] = lambda: None, progress: bool = True) -> str:
    """The sample text of the run's summary, generated from a KV cache (not through a CUDA graph
    where FSDP gathers weights inside every forward), with a progress bar; check() runs after each
    token, and may raise to stop."""
    # whole sequences in this process: not the ring of context parallelism
    model.set_attention(get_attention(cfg.attn.name, cfg.attn.backend))
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    with autocast(cfg.dtype, device), tqdm(total=cfg.sample_tokens, desc="sample", unit=" tokens", leave=False,
                                           disable=not progress, dynamic_ncols=True) as bar:
        def each_token() -> None:
            bar.update()
            check()
        out = model.generate(idx, cfg.sample_tokens, generator=gen, each_token=each_token,
                             doc_ids_of=document_ids if cfg.data.doc_mask else None, cuda_graph=cuda_graph)
    return enc.decode(out[0].tolist())
