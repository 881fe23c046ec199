"""Trains the GPT with the attention picked by `attn=`; logs to W&B (offline by default) and metrics.jsonl.

    .venv/bin/python train.py                                   # tiny model, Shakespeare, SDPA
    .venv/bin/python train.py experiment=gpt2_16k attn=triton seq_len=8192
    .venv/bin/python train.py -m attn=naive,sdpa,triton seq_len=512,1024
    torchrun --standalone --nproc_per_node=2 train.py attn=triton

train() is the loop, each step in the order it runs: forward and loss, backward, clip, optimizer
step, log, evaluate, checkpoint. Its parts live in trainer/: setup() builds the Run (run.py), the
optimizer and its schedule (optim.py), what a checkpoint holds (checkpoint.py), the end of a run
(finish.py), the commands a run prints (commands.py), a sweep's jobs (sweep.py), and the run dir,
metrics and W&B, the layout over processes, stop signals and the profiler. main() is the Hydra
entry point, after trainer/preflight.py has checked the command line; tests call train(cfg, run_dir).
"""

import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from trainer.startup import startup

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tqdm import tqdm  # noqa: E402

from configs.overrides import quoted_where_needed  # noqa: E402
from configs.runtime import autocast, memory_cap, out_of_memory, sdpa_backend  # noqa: E402
from configs.schema import TrainConfig  # noqa: E402
from configs.store import register_configs  # noqa: E402
from configs.validate import ConfigError, launch_env  # noqa: E402
from data import DatasetError, TokenizerError, TokenWindows, document_ids  # noqa: E402
from data.files import WriteError  # noqa: E402
from trainer.checkpoint import CHECKPOINT_NAME, CheckpointError, write_checkpoint  # noqa: E402
from trainer.commands import resume_hint, sweep_command, sweeping  # noqa: E402
from trainer.finish import finish  # noqa: E402
from trainer.optim import Diverged, check_finite, lr_at, set_lr, update  # noqa: E402
from trainer.preflight import FOLLOWER, placed, preflight  # noqa: E402
from trainer.profiling import Profiler  # noqa: E402
from trainer.run import Run, setup  # noqa: E402
from trainer.rundir import abandon_run_dir, release_run_dirs  # noqa: E402
from trainer.signals import Stopped, StopSignals, stop_signals  # noqa: E402
from trainer.sweep import record_skipped, start_sweep_job  # noqa: E402

register_configs()


# -----------------------------------------------------------------------------
# the loop


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Runs the whole training described by cfg, writing into run_dir; returns the summary."""
    with stop_signals() as stop, memory_cap(cfg.device):
        try:
            run = setup(cfg, Path(run_dir), stop.check)
        except Exception:
            stop.check()  # a stop signal that reached the tokenizing workers too: their failure is the stop's
            raise
        stop.start_loop()
        bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not run.master, dynamic_ncols=True,
                   desc=str(cfg.attn.name))
        profiler = Profiler(run.run_dir / "profile", run.device) if cfg.profile and run.master else None
        status, message = "ok", None
        try:
            while run.step < cfg.max_steps:
                # -- forward, loss and backward over grad_accum micro-batches --
                lr = begin_step(run)
                loss_sum = torch.zeros((), device=run.device)
                for micro in range(cfg.grad_accum):
                    # the processes reduce their gradients on the last micro-step only
                    run.par.sync_gradients(run.model, run.raw_model, micro == cfg.grad_accum - 1)
                    loss = forward(run, run.train_loader,
                                   backward=lambda loss: run.scaler.scale(loss / cfg.grad_accum).backward())
                    loss_sum += loss.detach()
                # -- clip, then the optimizer step (skipped on the device where a gradient is not finite) --
                run.scaler.unscale_(run.optimizer)  # fp16: clip (and log) the true gradients, not the scaled ones
                clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
                grad_norm = run.par.clip_grad_norm(run.model, clip)
                bad = update(run.optimizer, run.scaler, grad_norm, loss_sum)
                run.step += 1
                run.first_bad_step = torch.where(bad & (run.first_bad_step == 0), run.step, run.first_bad_step)
                run.meter.count_step()
                bar.update(1)
                # -- what falls due: a log record, an evaluation, a checkpoint --
                last = run.step == cfg.max_steps
                if due(run.step, cfg.log_interval, last):
                    log(run, loss_sum / cfg.grad_accum, grad_norm, lr, bar)
                if cfg.eval_steps and due(run.step, cfg.eval_interval, last):
                    evaluate(run, bar)
                if cfg.ckpt_interval >= 0 and due(run.step, cfg.ckpt_interval, last):
                    save(run)
                if profiler:
                    profiler.step()
                if signum := stop.signum(run.par):
                    stop.end_loop()  # a Ctrl-C now waits for the stop's checkpoint
                    status, message = "stopped", stop_for(run, signum)
                    run.info["signal"] = signal.Signals(signum).name
                    break
        except BaseException as e:
            if (ended := ended_early(run, e)) is None:  # a crash: W&B closed as failed; ckpt.pt stays the last good one
                if run.master:
                    run.log.run.finish(exit_code=1)
                raise
            status, message = ended
        finally:
            stop.end_loop()  # from here a stop, Ctrl-C too, waits for the run's files (trainer/signals.py)
            bar.close()
            if profiler:
                profiler.close()
        stop.settle()
        summary = finish(run, status, message, stop.check)
    # read once the block has handed the signals back (to a script's handlers, say): one that came
    # in between is recorded here, not lost
    if stop.received and summary["status"] == "ok":  # a stop as the run closed: it is whole, the process ends
        summary["signal"] = signal.Signals(stop.received).name
        given_up = cfg.sample_tokens > 0 and "sample" not in summary
        summary["message"] = (f"stopped by {summary['signal']} as the run closed: "
                              + "the end-of-run sample was given up; " * given_up
                              + f"it finished at step {run.step} and its files are written"
                              + (f": {resume_hint(run.run_dir)}" if sweeping() else ""))
    return summary


def due(step: int, every: int, last: bool) -> bool:
    """Whether what runs every `every` steps (0: at the last step only) falls due after `step`."""
    return last or (every > 0 and step % every == 0)


def begin_step(run: Run) -> float:
    """Readies the next step: the graphs' memory (CUDA graphs), the warmed-up windows, and the
    learning rate, which it returns."""
    new_graph_step(run)
    if run.cfg.attn.window_warmup:
        run.raw_model.warm_windows(run.step, run.cfg.attn.window_warmup)
    lr = lr_at(run.step, run.cfg)
    set_lr(run.optimizer, lr)
    return lr


def forward(run: Run, loader: TokenWindows, backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """The mean loss of the loader's next batch (this process's part of it), and backward(loss) if
    given, in the same context-parallel region as the forward (torch's ring runs only inside one)."""
    with run.par.split(*loader.next_batch()) as (x, y, pos):
        doc_ids = document_ids(x) if run.cfg.data.doc_mask else None
        with autocast(run.cfg.dtype, run.device), sdpa_backend(run.cfg.attn.sdpa_backend):
            loss = run.model(x, y, pos, doc_ids)[1]
        if backward is not None:
            backward(loss)
    return loss


def new_graph_step(run: Run) -> None:
    """Under CUDA graphs (compile_mode=reduce-overhead) a replay reuses the memory of the graphs'
    earlier outputs: called where all of them have been read (losses added up, gradients stepped and
    dropped), never between the micro-steps whose gradients accumulate."""
    if run.cfg.compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()


def diverged(run: Run, loss: float | None = None) -> None:
    """Raises Diverged if a step since the start diverged, or `loss` is not finite (trainer/optim.py)."""
    check_finite(run.first_bad_step, run.step, run.scaler.is_enabled(), run.cfg.optim.lr, loss)


def log(run: Run, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, bar: tqdm) -> None:
    """The step's record: its loss over the processes (a host sync: the timing is honest), to
    metrics.jsonl, W&B and the progress bar."""
    loss_val = run.par.mean(loss).item()
    diverged(run, loss_val)
    rec = run.meter.record(step=run.step, loss=loss_val, lr=lr, grad_norm=grad_norm.item(), attn=str(run.cfg.attn.name),
                           seq_len=run.cfg.seq_len)
    if run.master:
        run.log.log(rec)
        bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}")


@torch.no_grad()
def evaluate(run: Run, bar: tqdm) -> None:
    """The validation loss over the same eval_steps windows every time (comparable across steps),
    outside the throughput's clock; logged."""
    with run.meter.paused():
        run.val_loader.load_state_dict(run.val_start)
        run.model.eval()
        losses = []
        for _ in range(run.cfg.eval_steps):
            new_graph_step(run)
            losses.append(forward(run, run.val_loader).float().clone())  # a copy outlives the next replay
        loss = torch.stack(losses).mean()
        run.model.train()
        run.par.after_forward_only(run.raw_model)
        run.last_val = run.par.mean(loss).item()  # each rank saw its slice of the global validation batch
    run.best_val = min(run.best_val, run.last_val)
    if run.master:
        run.log.log({"step": run.step, "val_loss": run.last_val})
        bar.write(f"step {run.step}: val loss {run.last_val:.4f}")


def save(run: Run) -> None:
    """Checkpoints the run, outside the throughput's clock (rank 0 writes ckpt.pt; every rank's loader
    holds the same state, so rank 0's serves all; sharded, every rank writes its shards first)."""
    with run.meter.paused():
        diverged(run)
        write_checkpoint(run)
        run.saved_step = run.step


def last_checkpoint(run: Run) -> str:
    if run.saved_step is None:
        return "no checkpoint was written"
    return f"the last checkpoint (step {run.saved_step}) is {run.run_dir / CHECKPOINT_NAME}"


def ended_early(run: Run, e: BaseException) -> tuple[str, str] | None:
    """(status, message) for what ended the loop before max_steps; None for a crash, and, under
    torchrun, for what the other ranks cannot learn of (they wait in a collective: this process
    fails, and torchrun stops them)."""
    cfg, single = run.cfg, run.par.world == 1
    if isinstance(e, KeyboardInterrupt):
        said = f"interrupted at step {run.step}; {last_checkpoint(run)}: {resume_hint(run.run_dir)}"
        if single:
            run.info["signal"] = "SIGINT"
            return "stopped", said
        if run.master:
            print(said, file=sys.stderr)
        return None
    if out_of_memory(e) and single:
        return "oom", (f"out of {'GPU' if run.device.type == 'cuda' else 'CPU'} memory at step {run.step + 1} with "
                       f"attn={cfg.attn.name} seq_len={cfg.seq_len} batch_size={cfg.batch_size}: lower batch_size or "
                       "seq_len" + (", or use attn=sdpa/triton" if cfg.attn.name == "naive" else ""))
    if isinstance(e, (Diverged, WriteError, CheckpointError)):
        return ("diverged" if isinstance(e, Diverged) else "failed"), f"{e}; {last_checkpoint(run)}"
    if isinstance(e, DatasetError):  # its files changed under the run: a resume checks them and prepares them again
        then = resume_hint(run.run_dir) if run.saved_step is not None else "the same command starts the run again"
        return "failed", f"{e}; {last_checkpoint(run)}: {then}"
    return None


def stop_for(run: Run, signum: int) -> str:
    """Checkpoints the last step (unless ckpt_interval=-1) on the way out for a stop signal; the
    line that says so."""
    if run.cfg.ckpt_interval >= 0 and run.saved_step != run.step:
        save(run)
    run.par.barrier()  # no rank exits (and has torchrun stop the others) before rank 0's save is whole
    said = f"stopped by {signal.Signals(signum).name} after step {run.step}; {last_checkpoint(run)}"
    if run.saved_step is None:
        return f"{said} (ckpt_interval=-1): the run cannot continue"
    return f"{said}: {resume_hint(run.run_dir)}"


def exit_code(summary: dict) -> int:
    """A stopped run exits as the signal would have ended it (143 for SIGTERM), a failed one 1."""
    if "signal" in summary:
        return 128 + signal.Signals[summary["signal"]].value
    return 0 if summary["status"] == "ok" else 1



@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        done = start_sweep_job(cfg, run_dir) if sweep else None
        if sweep:  # jobs compile apart: dynamo keeps 8 graphs per function, then runs it eagerly (flex: unfused)
            torch._dynamo.reset()
        if done is not None:
            print(f"{run_dir.name}: skipped: its run finished at step {done['steps']} (a larger max_steps trains it "
                  "further; other settings need another hydra.sweep.dir)", file=sys.stderr)
            return done.get("final_val_loss")
        summary = train(cfg, run_dir)
    except WriteError as e:  # preparing data or a cache before training started
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Stopped as e:
        if sweep:
            print(f"stopped by {signal.Signals(e.signum).name} before the first step of {run_dir.name}; nothing of it "
                  f"was saved: {sweep_command()} continues the sweep", file=sys.stderr)
        else:
            print(e, file=sys.stderr)
        abandon_run_dir(run_dir)
        sys.exit(128 + e.signum)
    except (ConfigError, DatasetError, CheckpointError, TokenizerError) as e:
        if not sweep:
            print(f"error: {e}", file=sys.stderr)
            abandon_run_dir(run_dir)
            sys.exit(2)
        record_skipped(run_dir, e)  # in its own dir only; the sweep goes on
        return None
    if summary["message"] and int(os.environ.get("RANK", "0")) == 0:
        print(summary["message"], file=sys.stderr)
    # a failed sweep job is recorded and the next one runs; a stop stops the sweep (as the run closed too)
    if "signal" in summary or (summary["status"] != "ok" and not sweep):
        sys.exit(exit_code(summary))
    return summary["final_val_loss"]


if __name__ == "__main__":
    # a log record that cannot be written (train.log or W&B's debug.log on a full disk) is dropped, not
    # printed as a traceback: the write that matters says what failed in its own line
    logging.raiseExceptions = False
    # the stop signals are this process's from before its run dir is claimed to its exit, every job of a sweep too
    with StopSignals() as stopping:
        argv = quoted_where_needed(sys.argv[1:], TrainConfig)  # any path as typed: hydra.run.dir=/data/ü_日本
        try:
            follower = launch_env()["RANK"] > 0
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.argv[1:] = placed(argv, FOLLOWER if follower else preflight(argv))
        try:
            main()
        except KeyboardInterrupt:
            sys.exit(130)  # under torchrun: train() said where to resume
        finally:
            release_run_dirs()
        if stopping.received:  # after the last point that acts on one (Hydra's own --help, --cfg ...)
            print(f"train.py: stopped by {signal.Signals(stopping.received).name} as it ended; what it did is complete",
                  file=sys.stderr)
            sys.exit(128 + stopping.received)
