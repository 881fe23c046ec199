"""Trains the GPT with the attention picked by `attn=`; logs to W&B (offline by default) and metrics.jsonl.

    python train.py                                   # tiny model, Shakespeare, SDPA
    python train.py experiment=gpt2_16k attn=triton seq_len=8192
    python train.py -m attn=naive,sdpa,triton seq_len=512,1024
    torchrun --standalone --nproc_per_node=2 train.py attn=triton

Shaped like torchtitan's trainer: setup() builds one Run, train_step() makes one optimizer step,
state_dict()/load_state_dict() are everything a checkpoint holds, finish() writes the summary.
train(cfg, run_dir) runs them (tests call it); main() is the Hydra entry point, after
trainer/preflight.py has checked the command line. The run's parts live in trainer/: its
directory, checkpoints, metrics and W&B, its layout over processes, stop signals, the profiler.
"""

import contextlib
import importlib.metadata
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
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
from configs.runtime import (autocast, autocast_dtype, fsdp_param_dtype, grad_scaler, memory_cap,  # noqa: E402
                             out_of_memory, precision, precision_line, probe_sdpa_backend, resolve_device, sdpa_backend)
from configs.schema import TrainConfig, plain  # noqa: E402
from configs.store import register_configs  # noqa: E402
from configs.validate import (ConfigError, batch_size_per_process, check_resume, launch_env,  # noqa: E402
                              validate)
from kernels.backends import backends as attention_backends  # noqa: E402
from data import DatasetError, TokenizerError, TokenWindows, document_ids, get_encoding  # noqa: E402
from data.files import WriteError, atomic_write  # noqa: E402
from data.prepare import prepare_on_node  # noqa: E402
from model import GPT, get_attention  # noqa: E402
from model.attention import Modifications, sdpa_masked  # noqa: E402
from trainer.commands import (continue_command, resume_hint, sample_command, shown, started_here,  # noqa: E402
                              sweep_command, sweeping)
from trainer.checkpoint import (CHECKPOINT_NAME, CheckpointError, load_checkpoint, load_weights,  # noqa: E402
                                save_checkpoint)
from trainer.metrics import json_line, read_metrics  # noqa: E402
from trainer.parallel import Parallel, ShardedAdamW  # noqa: E402
from trainer.preflight import FOLLOWER, placed, preflight  # noqa: E402
from trainer.profiling import Profiler  # noqa: E402
from trainer.curves import CURVES_NAME, write_curves  # noqa: E402
from trainer.report import Meter, RunLog, outcome_lines  # noqa: E402
from trainer.rundir import (abandon_run_dir, claim_run_dir, finished_summary, holds, release_run_dirs,  # noqa: E402
                            resume_target, write_record)
from trainer.signals import Stopped, StopSignals, stop_signals  # noqa: E402

register_configs()


class Diverged(RuntimeError):
    """The loss or the gradient norm became NaN or inf."""


# -----------------------------------------------------------------------------
# helpers


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # attn=naive/sdpa run without it
        return "not installed"


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to optim.lr * min_lr_ratio at max_steps."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: DictConfig, sharded: bool = False) -> torch.optim.AdamW:
    # decay matmul weights and embeddings (>= 2-D); never biases or LayerNorm gains. Fused (CPU and
    # CUDA): one kernel, and it honours found_inf, which train_step uses to skip a non-finite update.
    # sharded (FSDP): the same AdamW stepping each process's shards (trainer/parallel.py)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    adamw = ShardedAdamW if sharded else torch.optim.AdamW
    return adamw(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)


# -----------------------------------------------------------------------------
# the run


@dataclass
class Run:
    cfg: DictConfig
    run_dir: Path
    par: Parallel  # the processes, this one's place among them, its device
    model: torch.nn.Module  # what the loop calls: compiled and/or wrapped in DDP
    raw_model: GPT  # what a checkpoint holds
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # dtype=float16's loss scale; disabled (every call a no-op) otherwise
    train_loader: TokenWindows
    val_loader: TokenWindows | None  # None with eval_steps=0
    meter: Meter
    info: dict
    log: RunLog | None = None  # rank 0 only
    step: int = 0
    best_val: float = math.inf
    last_val: float | None = None
    # on the device: the first step that diverged (its gradient norm, under fp16 its loss, was not finite)
    first_bad_step: torch.Tensor | None = None
    saved_step: int | None = None  # of the last checkpoint written (or resumed from)
    val_start: dict = field(default_factory=dict)

    @property
    def master(self) -> bool:  # rank 0 alone writes: run dir, metrics, W&B, checkpoints, progress bar
        return self.par.master

    @property
    def device(self) -> torch.device:
        return self.par.device


def state_dict(run: Run) -> dict:
    """Everything a checkpoint holds; load_state_dict below restores exactly this. Sharded, every rank
    must call it, and rank 0's holds the weights and optimizer state."""
    model, optimizer = run.par.state_dict(run.raw_model, run.optimizer)
    return {"step": run.step, "model": model, "optimizer": optimizer,
            "loader": run.train_loader.state_dict(), "best_val_loss": run.best_val,
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None},
            "config": plain(run.cfg), "world_size": run.par.world, "data_parallel": run.par.dp,
            "wandb_id": run.log.run.id if run.log else None, "grad_scaler": run.scaler.state_dict()}


def load_state_dict(run: Run, state: dict) -> None:
    run.step, run.best_val = state["step"], state["best_val_loss"]
    run.par.load_state_dict(run.raw_model, run.optimizer, state["model"], state["optimizer"],
                            lambda model, weights: load_weights(model, weights, run.cfg.resume))
    run.train_loader.load_state_dict(state["loader"])
    if state["grad_scaler"]:  # {} from a run without fp16 (dtype=auto on another GPU): a fresh scale
        run.scaler.load_state_dict(state["grad_scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if run.device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], run.device)


def setup(cfg: DictConfig, run_dir: Path, check: Callable[[], None] = lambda: None) -> Run:
    """Checks cfg, then builds everything the loop needs, resumed from cfg.resume if set. check()
    runs between stages and inside dataset preparation: it raises to stop setup there."""
    validate(cfg, launch_env()["WORLD_SIZE"])
    par = Parallel.start(resolve_device(cfg.device), cfg.parallel.cp, cfg.parallel.dp == "fsdp",
                         get_attention(cfg.attn.name).context_parallel, cfg.parallel.cp_rotate)
    cfg.batch_size = batch_size_per_process(cfg, par.world)
    ckpt, run_dir = resume_point(cfg, par, Path(run_dir))
    if par.master:
        claim_run_dir(run_dir, fresh=ckpt is None)
    if cfg.sample_tokens > 0:
        get_encoding()  # the sample at the end needs it: a bad tokenizer cache is found now, not after training
    check()

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    if par.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # a sweep runs its jobs in one process: start this job's memory peaks from its own baseline
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(par.device)

    dataset_dir = prepare_on_node(cfg.data, par.local_rank, par.barrier, check)
    check()
    # each data-parallel rank takes its own slice of one global batch (data/loader.py)
    data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    train_loader = TokenWindows(dataset_dir, "train", cfg.seq_len, cfg.batch_size, par.device, data_seed,
                                par.dp_rank, par.dp, cfg.data.cycle)
    val_loader = (TokenWindows(dataset_dir, "val", cfg.seq_len, cfg.batch_size, par.device, cfg.seed, par.dp_rank,
                               par.dp, cfg.data.cycle) if cfg.eval_steps else None)
    raw_model = build_model(cfg, par)
    info = run_info(cfg, par, raw_model)
    # before the optimizer: it holds the shards
    if units := par.shard(raw_model, fsdp_param_dtype(cfg.parallel.param_dtype, cfg.dtype, par.device),
                          cfg.parallel.reshard_after_forward, cfg.parallel.unit_params):
        info["fsdp_blocks_per_unit"] = units
    run = Run(cfg=cfg, run_dir=run_dir, par=par, model=raw_model, raw_model=raw_model,
              optimizer=make_optimizer(raw_model, cfg, par.sharded), scaler=grad_scaler(cfg.dtype, par.device),
              train_loader=train_loader, val_loader=val_loader,
              val_start=val_loader.state_dict() if val_loader else {}, info=info,
              meter=Meter(info["tokens_per_step"], raw_model.flops_per_token(cfg.seq_len), par.device, par.world),
              first_bad_step=torch.zeros((), dtype=torch.long, device=par.device))
    if ckpt is not None:
        load_state_dict(run, ckpt)
        run.saved_step = run.step
        if run.step == cfg.max_steps and run.master:
            recorded_end(run)
    if par.world > 1:
        torch.manual_seed(cfg.seed + par.rank)  # same initial weights everywhere, but each rank its own dropout
    if cfg.compile and cfg.attn.window_warmup:  # each warmed window is a graph of its own, training's and eval's
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 + 2 * 8)
    run.model = par.wrap(raw_model, cfg.compile, cfg.compile_mode)
    check()  # the last point where a stop leaves nothing behind: W&B's run starts next
    if run.master:
        run.log = RunLog(run.run_dir, cfg, ckpt["wandb_id"] if ckpt else None, ckpt["step"] if ckpt else None)
        run.log.run.config.update(info, allow_val_change=True)
        print(precision_line(cfg.dtype, par.device))
        print(f"run dir {run.run_dir} | {info}", flush=True)
    run.meter.restart()
    return run


def resume_point(cfg: DictConfig, par: Parallel, run_dir: Path) -> tuple[dict | None, Path]:
    """(the checkpoint to continue from, the run dir), or (None, run_dir) for a fresh run. Metrics,
    W&B and checkpoints continue in the original run's dir; a run that stopped before its first
    checkpoint starts again there (claim_run_dir says so)."""
    if not cfg.resume:
        return None, run_dir
    path, run_dir = resume_target(hydra.utils.to_absolute_path(cfg.resume))
    if path is None:
        return None, run_dir
    ckpt = load_checkpoint(path)
    changes = check_resume(ckpt, plain(cfg), par.dp, path)
    step = ckpt["step"]
    if step > cfg.max_steps or (step == cfg.max_steps and finished_summary(run_dir) is not None):
        raise ConfigError(f"resume={cfg.resume}: that run already finished at step {step}; "
                          f"raise max_steps above {step} to train it further")
    if par.master:
        doing = (f"finishing {run_dir}: it trained to step {step} but did not finish (no summary)"
                 if step == cfg.max_steps else f"resuming {run_dir} at step {step}")
        print(doing + (f"; changed: {changes}" if changes else ""))
    return ckpt, run_dir


def recorded_end(run: Run) -> None:
    """A run resumed at its last step only finishes (summary, sample, W&B): its last losses and its
    throughput come from its metrics.jsonl."""
    records = read_metrics(run.run_dir / "metrics.jsonl")
    run.meter.restore([r for r in records if "loss" in r])
    run.last_val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)


def build_model(cfg: DictConfig, par: Parallel) -> GPT:
    """The GPT on this process's device, with the attention the layout calls (the ring under cp)."""
    try:
        return GPT(cfg.model, par.attention(get_attention(cfg.attn.name, cfg.attn.backend)), cfg.ac,
                   cfg.attn.window, Modifications.of(cfg.attn)).to(par.device)
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        m = cfg.model
        raise ConfigError(f"model.n_layer={m.n_layer} model.d_model={m.d_model}: the model does not fit in "
                          f"{par.device.type} memory ({str(e).splitlines()[0][:100]}): choose a smaller one") from None


def run_info(cfg: DictConfig, par: Parallel, model: GPT) -> dict:
    """What the run is, for its log line, W&B's config and summary.json; SDPA's backend as torch picks it."""
    device = par.device
    info = {"params": model.num_params(), "tokens_per_step": cfg.batch_size * cfg.seq_len * cfg.grad_accum * par.dp,
            "world_size": par.world, "cp": cfg.parallel.cp, "dp": str(cfg.parallel.dp),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version(), "precision": precision(cfg.dtype, device)}
    if cfg.attn.name == "triton":  # which kernels run it: attn.backend may pick the Hopper ones, or not
        dtype = autocast_dtype(cfg.dtype, device) or torch.float32
        try:
            # under context parallelism the ring's shortest calls attend half a rank's queries:
            # the kernels those run
            queries = cfg.seq_len // (2 * cfg.parallel.cp) if cfg.parallel.cp > 1 else cfg.seq_len
            info["attention_kernels"] = attention_backends(cfg.model.d_model // cfg.model.n_head, dtype, device,
                                                           queries, cfg.attn.backend,
                                                           bool(cfg.attn.softcap or cfg.attn.alibi or cfg.attn.prefix))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.attn.name == "sdpa":
        dtype = autocast_dtype(cfg.dtype, device) or torch.float32
        # what the layers mask: documents, a prefix, a bias (ALiBi, sinks), the shortest window
        masked = bool(cfg.data.doc_mask or cfg.attn.prefix or cfg.attn.alibi or cfg.attn.sinks)
        window = min((w for w in cfg.model.window_pattern if w), default=cfg.attn.window)
        try:
            head_dim = cfg.model.d_model // cfg.model.n_head
            # under context parallelism each call attends a rank's shard
            info["sdpa_backend"] = probe_sdpa_backend(cfg.seq_len // cfg.parallel.cp, cfg.model.n_head, head_dim,
                                                      dtype, device, cfg.attn.sdpa_backend,
                                                      sdpa_masked(masked, window, cfg.seq_len, cfg.seq_len),
                                                      cfg.model.n_kv_head)
        except RuntimeError as e:
            raise ConfigError(f"attn.sdpa_backend={cfg.attn.sdpa_backend}: torch has no such kernel for these "
                              f"inputs on {device.type} ({str(e).splitlines()[0][:120]}): choose another or null")
    return info


# -----------------------------------------------------------------------------
# steps


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


def train_step(run: Run) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum micro-batches: (mean loss, grad norm) on the device, unsynced, and the lr."""
    cfg = run.cfg
    new_graph_step(run)
    if cfg.attn.window_warmup:
        run.raw_model.warm_windows(run.step, cfg.attn.window_warmup)
    lr = lr_at(run.step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        # reduce gradients over the processes only on the last micro-step
        run.par.sync_gradients(run.model, run.raw_model, micro == cfg.grad_accum - 1)
        loss = forward(run, run.train_loader, lambda loss: run.scaler.scale(loss / cfg.grad_accum).backward())
        loss_sum += loss.detach()
    run.scaler.unscale_(run.optimizer)  # fp16: clip (and log) the true gradients, not the scaled ones
    grad_norm = run.par.clip_grad_norm(run.model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
    bad = optimizer_step(run, grad_norm, loss_sum)
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.first_bad_step = torch.where(bad & (run.first_bad_step == 0), run.step, run.first_bad_step)
    return loss_sum / cfg.grad_accum, grad_norm, lr


def optimizer_step(run: Run, grad_norm: torch.Tensor, loss_sum: torch.Tensor) -> torch.Tensor:
    """The optimizer step, skipped on the device (no host sync) where a gradient is not finite;
    returns whether this step diverged, on the device: the loop stops at its next sync (check_finite)."""
    if run.scaler.is_enabled():
        # fp16: an overflow under the loss scale is the scaler's to skip, halving the scale (the fused
        # AdamW reads its found_inf), and no divergence; a loss that is not finite still is one
        run.scaler.step(run.optimizer)
        run.scaler.update()
        return ~torch.isfinite(loss_sum)
    bad = ~torch.isfinite(grad_norm)
    run.optimizer.found_inf = bad.float()  # the fused AdamW skips the whole update
    run.optimizer.step()
    return bad


def check_finite(run: Run, loss: float | None = None) -> None:
    """Raises Diverged if a step since the start diverged (optimizer_step says which do), or `loss` is not finite."""
    bad_step = int(run.first_bad_step.item())
    if bad_step or (loss is not None and not math.isfinite(loss)):
        what = (f"the {'loss' if run.scaler.is_enabled() else 'gradient norm'} at step {bad_step}" if bad_step
                else f"the loss at step {run.step}")
        raise Diverged(f"training diverged: {what} is not finite; that update was skipped and the run stopped "
                       f"(optim.lr={run.cfg.optim.lr})")


@torch.no_grad()
def evaluate(run: Run) -> float:
    run.val_loader.load_state_dict(run.val_start)  # the same validation windows every time: comparable across steps
    run.model.eval()
    losses = []
    for _ in range(run.cfg.eval_steps):
        new_graph_step(run)
        losses.append(forward(run, run.val_loader).float().clone())  # a copy outlives the next replay
    loss = torch.stack(losses).mean()
    run.model.train()
    run.par.after_forward_only(run.raw_model)
    return run.par.mean(loss).item()  # each rank saw its slice of the global validation batch


def save(run: Run) -> None:
    """Checkpoints the run (rank 0; every rank's loader holds the same state, so rank 0's serves all)."""
    check_finite(run)
    state = state_dict(run) if run.master or run.par.sharded else None  # sharded: every rank gathers
    if run.master:
        save_checkpoint(run.run_dir / CHECKPOINT_NAME, state)
    run.saved_step = run.step


def last_checkpoint(run: Run) -> str:
    if run.saved_step is None:
        return "no checkpoint was written"
    return f"the last checkpoint (step {run.saved_step}) is {run.run_dir / CHECKPOINT_NAME}"


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
                step(run, bar)
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


def step(run: Run, bar: tqdm) -> None:
    """One training step, then what falls due after it: a log record, an evaluation, a checkpoint."""
    cfg = run.cfg
    loss, grad_norm, lr = train_step(run)
    run.meter.count_step()
    bar.update(1)
    last = run.step == cfg.max_steps
    if run.step % cfg.log_interval == 0 or last:
        loss_val = run.par.mean(loss).item()  # syncs the device: the timing below is honest
        check_finite(run, loss_val)
        rec = run.meter.record(step=run.step, loss=loss_val, lr=lr, grad_norm=grad_norm.item(),
                               attn=str(cfg.attn.name), seq_len=cfg.seq_len)
        if run.master:
            run.log.log(rec)
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}")
    if cfg.eval_steps and ((cfg.eval_interval and run.step % cfg.eval_interval == 0) or last):
        with run.meter.paused():
            run.last_val = evaluate(run)
        run.best_val = min(run.best_val, run.last_val)
        if run.master:
            run.log.log({"step": run.step, "val_loss": run.last_val})
            bar.write(f"step {run.step}: val loss {run.last_val:.4f}")
    if cfg.ckpt_interval >= 0 and ((cfg.ckpt_interval and run.step % cfg.ckpt_interval == 0) or last):
        with run.meter.paused():
            save(run)


def stop_for(run: Run, signum: int) -> str:
    """Checkpoints the last step (unless ckpt_interval=-1) on the way out for a stop signal; the
    line that says so."""
    if run.cfg.ckpt_interval >= 0 and run.saved_step != run.step:
        with run.meter.paused():
            save(run)
    run.par.barrier()  # no rank exits (and has torchrun stop the others) before rank 0's save is whole
    said = f"stopped by {signal.Signals(signum).name} after step {run.step}; {last_checkpoint(run)}"
    if run.saved_step is None:
        return f"{said} (ckpt_interval=-1): the run cannot continue"
    return f"{said}: {resume_hint(run.run_dir)}"


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


def exit_code(summary: dict) -> int:
    """A stopped run exits as the signal would have ended it (143 for SIGTERM), a failed one 1."""
    if "signal" in summary:
        return 128 + signal.Signals[summary["signal"]].value
    return 0 if summary["status"] == "ok" else 1


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
        # a sweep job that cannot run is recorded with its reason (in its own dir only) and skipped; the sweep goes on
        print(f"error: {e} (this job is skipped; the sweep goes on)", file=sys.stderr)
        if holds(run_dir) and not any((run_dir / name).exists() for name in ("summary.json", CHECKPOINT_NAME)):
            try:
                atomic_write(run_dir / "summary.json", json_line({"status": "skipped", "message": str(e)}).encode())
            except WriteError as write:
                print(f"error: {write}", file=sys.stderr)
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
