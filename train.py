"""Trains the GPT with the attention picked by `attn=`; logs to W&B (offline by default) and metrics.jsonl.

    python train.py                                   # tiny model, Shakespeare, SDPA
    python train.py experiment=gpt2_16k attn=triton seq_len=8192
    python train.py -m attn=naive,sdpa,triton seq_len=512,1024
    torchrun --standalone --nproc_per_node=2 train.py attn=triton

Shaped like torchtitan's trainer: setup() builds one Run, train_step() makes one optimizer step,
a Meter owns tokens/s, MFU, memory and the history, state_dict()/load_state_dict() are everything
a checkpoint holds, finish() writes the summary. train(cfg, run_dir) runs them (tests call it);
main() is the Hydra entry point, after configs/preflight.py has checked the command line.
"""

import contextlib
import importlib.metadata
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from configs.overrides import quoted_where_needed, shell_override
from configs.preflight import abandon_run_dir, claim_run_dir, preflight, resume_target
from configs.runtime import autocast, resolve_device, uses_bf16, wandb_mode, wandb_online_problem
from configs.store import register_configs
from configs.validate import ConfigError, batch_size_per_process, check_resume, data_parallel_size, validate
from data import DatasetError, TokenWindows, get_encoding
from data.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint, load_weights, save_checkpoint
from data.files import DiskFullError, atomic_write
from data.metrics import json_line, read_metrics, steady
from data.prepare import prepare_on_node
from model import GPT
from model.attention import probe_sdpa_backend, sdpa_backend
from trainer.profiling import Profiler
from model.context_parallel import ContextParallel

register_configs()

# dense bf16 tensor-core peak by datasheet, for MFU; substrings of torch.cuda.get_device_name()
GPU_PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12,
                       "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12,
                       "RTX 4090": 165e12, "RTX 3090": 71e12}


class Diverged(RuntimeError):
    """The loss or the gradient norm became NaN or inf."""


# -----------------------------------------------------------------------------
# helpers


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # attn=naive/sdpa run without it
        return "not installed"


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16_FLOPS.items() if key in name), None)


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to optim.lr * min_lr_ratio at max_steps."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: DictConfig) -> torch.optim.AdamW:
    # decay matmul weights and embeddings (>= 2-D); never biases or LayerNorm gains. Fused (CPU and
    # CUDA): one kernel, and it honours found_inf, which train_step uses to skip a non-finite update
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             eps=cfg.optim.eps, fused=True)


def setup_distributed(cfg: DictConfig) -> tuple[int, int, int, torch.device]:
    """(rank, world size, local rank, device): one process per GPU under torchrun, else one process."""
    device = resolve_device(cfg.device)
    if "RANK" not in os.environ:
        return 0, 1, 0, device
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} needs GPU {local_rank}, but only "
                              f"{torch.cuda.device_count()} are visible: lower --nproc_per_node")
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return rank, world, local_rank, device


def context_parallel(cfg: DictConfig, rank: int, world: int, device: torch.device) -> tuple[ContextParallel | None, int]:
    """(this rank's context-parallel group or None, its data-parallel rank): the processes form a
    (world / cp) x cp grid; the cp ranks of a row split each of its sequences (ring attention),
    the rows are data-parallel (each its own batch; DDP averages gradients over all processes)."""
    cp = cfg.parallel.cp
    if cp == 1:
        return None, rank
    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return ContextParallel.of(mesh.get_group("cp")), mesh.get_local_rank("dp")


def shard_model(model: GPT, world: int, device: torch.device) -> None:
    """FSDP2 in place: each block, then the rest (embedding, tied head, final norm), sharded over all
    processes; a block's weights are gathered for its forward and backward, its gradients
    reduce-scattered (averaged over all processes, as DDP does)."""
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# checkpoints hold whole tensors whatever the sharding: gathered to rank 0 (on the CPU) to save,
# and every rank loads the whole checkpoint and keeps its shard
_WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)


# -----------------------------------------------------------------------------
# metrics


class Meter:
    """Tokens/s, MFU and peak memory between log points, and the history of logged records."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, device: torch.device, world: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.device, self.world = device, world
        self.peak_flops = gpu_peak_flops(device)
        self.history: list[dict] = []
        self.peaks = {"peak_mem_alloc_gib": None, "peak_mem_reserved_gib": None}  # GPU only
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
        for k in self.peaks:
            if rec[k] is not None:
                self.peaks[k] = max(self.peaks[k] or 0.0, rec[k])
        self.history.append(rec)
        self.restart()
        return rec

    def _memory(self) -> dict:
        """Peak allocated/reserved GiB since the previous record (max over ranks); None on CPU."""
        if self.device.type != "cuda":
            return dict.fromkeys(self.peaks)
        peaks = torch.tensor([torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)],
                             dtype=torch.float64, device=self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.world > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        return {"peak_mem_alloc_gib": peaks[0].item(), "peak_mem_reserved_gib": peaks[1].item()}

    def summary(self) -> dict:
        records = steady(self.history)
        return {"mean_tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records) if records else None,
                **self.peaks}


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

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json_line(record))
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self.run.log(numbers, step=record["step"])

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if k != "sample"})
        if summary["status"] == "stopped":  # W&B shows it as preempted, to be resumed
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if summary["status"] == "ok" else 1)


def open_wandb(cfg: DictConfig, run_dir: Path, **kwargs):
    """wandb.init in the mode cfg resolves to (configs/runtime.py): online where W&B can be reached
    with a key, else offline with one line saying why and how to upload the run later."""
    import wandb  # slow to import: only the processes that log pay for it

    mode = wandb_mode(cfg.wandb.mode)
    if mode == "online" and (problem := wandb_online_problem()):
        print(f"wandb: {problem}; logging offline instead (upload it later: wandb sync "
              f"{shlex.quote(str(run_dir / 'wandb'))}/offline-run-*)", file=sys.stderr)
        mode = "offline"
    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, tags=list(cfg.wandb.tags), mode=mode,
                      dir=str(run_dir), **kwargs)


def plain(cfg: DictConfig) -> dict:
    """cfg as plain Python values (choices as strings): for checkpoints, W&B and JSON."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


# -----------------------------------------------------------------------------
# the run


@dataclass
class Run:
    cfg: DictConfig
    run_dir: Path
    rank: int
    world: int
    dp: int  # data-parallel processes: world / parallel.cp
    sharded: bool  # FSDP2 (parallel.dp=fsdp under torchrun): state dicts are collective
    device: torch.device
    model: torch.nn.Module  # what the loop calls: compiled and/or wrapped in DDP
    raw_model: GPT  # what a checkpoint holds
    optimizer: torch.optim.Optimizer
    train_loader: TokenWindows
    val_loader: TokenWindows | None  # None with eval_steps=0
    meter: Meter
    info: dict
    log: RunLog | None = None  # rank 0 only
    step: int = 0
    best_val: float = math.inf
    last_val: float | None = None
    first_bad_step: torch.Tensor | None = None  # on the device: the first step whose gradient was not finite
    saved_step: int | None = None  # of the last checkpoint written (or resumed from)
    val_start: dict = field(default_factory=dict)

    @property
    def master(self) -> bool:  # rank 0 alone writes: run dir, metrics, W&B, checkpoints, progress bar
        return self.rank == 0


def state_dict(run: Run) -> dict:
    """Everything a checkpoint holds; load_state_dict below restores exactly this. Sharded, every rank
    must call it, and rank 0's holds the weights and optimizer state."""
    if run.sharded:
        model = get_model_state_dict(run.raw_model, options=_WHOLE)
        optimizer = get_optimizer_state_dict(run.raw_model, run.optimizer, options=_WHOLE)
    else:
        model, optimizer = run.raw_model.state_dict(), run.optimizer.state_dict()
    return {"step": run.step, "model": model, "optimizer": optimizer,
            "loader": run.train_loader.state_dict(), "best_val_loss": run.best_val,
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None},
            "config": plain(run.cfg), "world_size": run.world, "data_parallel": run.dp,
            "wandb_id": run.log.run.id if run.log else None}


def load_state_dict(run: Run, state: dict) -> None:
    run.step, run.best_val = state["step"], state["best_val_loss"]
    if run.sharded:
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(run.raw_model, state["model"], options=whole)
        set_optimizer_state_dict(run.raw_model, run.optimizer, state["optimizer"], options=whole)
    else:
        load_weights(run.raw_model, state["model"], run.cfg.resume)
        run.optimizer.load_state_dict(state["optimizer"])
    run.train_loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"]["cpu"])
    if run.device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], run.device)


def setup(cfg: DictConfig, run_dir: Path) -> Run:
    """Checks cfg, then builds everything the loop needs, resumed from cfg.resume if set."""
    rank, world, local_rank, device = setup_distributed(cfg)
    validate(cfg, world)
    cfg.batch_size = batch_size_per_process(cfg, world)
    dp = data_parallel_size(cfg, world)
    ckpt = None
    if cfg.resume:
        # metrics, W&B and checkpoints continue in the original run's dir; one stopped before its
        # first checkpoint starts again there (claim_run_dir says so)
        path, run_dir = resume_target(hydra.utils.to_absolute_path(cfg.resume))
        if path is not None:
            ckpt = load_checkpoint(path)
            changes = check_resume(ckpt, plain(cfg), dp, path)
            if ckpt["step"] >= cfg.max_steps:
                raise ConfigError(f"resume={cfg.resume}: that run already finished at step {ckpt['step']}; "
                                  f"raise max_steps above {ckpt['step']} to train it further")
            if rank == 0:
                print(f"resuming {run_dir} at step {ckpt['step']}" + (f"; changed: {changes}" if changes else ""))
    if rank == 0:
        claim_run_dir(run_dir, fresh=ckpt is None)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # a sweep runs its jobs in one process: start this job's memory peaks from its own baseline
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    dataset_dir = prepare_on_node(cfg.data, local_rank, dist.barrier if world > 1 else lambda: None)
    cp, dp_rank = context_parallel(cfg, rank, world, device)
    # each data-parallel rank takes its own slice of one global batch (data/loader.py)
    data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    train_loader = TokenWindows(dataset_dir, "train", cfg.seq_len, cfg.batch_size, device, data_seed, dp_rank, dp)
    val_loader = (TokenWindows(dataset_dir, "val", cfg.seq_len, cfg.batch_size, device, cfg.seed, dp_rank, dp)
                  if cfg.eval_steps else None)

    try:
        raw_model = GPT(cfg.model, cfg.attn.name, cfg.ac, cfg.data.doc_mask, cp).to(device)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:  # RuntimeError: the CPU allocator's
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "alloc" not in str(e):
            raise
        m = cfg.model
        raise ConfigError(f"model.n_layer={m.n_layer} model.d_model={m.d_model}: the model does not fit in "
                          f"{device.type} memory ({str(e).splitlines()[0][:100]}): choose a smaller one") from None
    info = {"params": raw_model.num_params(), "tokens_per_step": cfg.batch_size * cfg.seq_len * cfg.grad_accum * dp,
            "world_size": world, "cp": cfg.parallel.cp, "dp": str(cfg.parallel.dp),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version()}
    if cfg.attn.name == "sdpa":
        dtype = torch.bfloat16 if uses_bf16(cfg.dtype, device) else torch.float32
        try:
            head_dim = cfg.model.d_model // cfg.model.n_head
            info["sdpa_backend"] = probe_sdpa_backend(cfg.seq_len, cfg.model.n_head, head_dim, dtype, device,
                                                      cfg.attn.sdpa_backend, cfg.data.doc_mask)
        except RuntimeError as e:
            raise ConfigError(f"attn.sdpa_backend={cfg.attn.sdpa_backend}: torch has no such kernel for these "
                              f"inputs on {device.type} ({str(e).splitlines()[0][:120]}): choose another or null")
    flops_per_token = raw_model.flops_per_token(cfg.seq_len)
    sharded = dist.is_initialized() and cfg.parallel.dp == "fsdp"
    if sharded:  # before the optimizer: it holds the shards
        shard_model(raw_model, world, device)
    run = Run(cfg=cfg, run_dir=Path(run_dir), rank=rank, world=world, dp=dp, sharded=sharded, device=device,
              model=raw_model, raw_model=raw_model, optimizer=make_optimizer(raw_model, cfg), train_loader=train_loader,
              val_loader=val_loader, val_start=val_loader.state_dict() if val_loader else {}, info=info,
              meter=Meter(info["tokens_per_step"], flops_per_token, device, world),
              first_bad_step=torch.zeros((), dtype=torch.long, device=device))
    if ckpt is not None:
        load_state_dict(run, ckpt)
        run.saved_step = run.step
    if world > 1:
        torch.manual_seed(cfg.seed + rank)  # same initial weights everywhere, but each rank its own dropout
    if cfg.compile:
        run.model = torch.compile(run.model)
    if world > 1 and not sharded:
        # gradients live in the all-reduce buckets: no copy in and out of them after backward
        run.model = DDP(run.model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True)
    if run.master:
        run.log = RunLog(run.run_dir, cfg, ckpt["wandb_id"] if ckpt else None, ckpt["step"] if ckpt else None)
        run.log.run.config.update(info, allow_val_change=True)
        print(f"run dir {run.run_dir} | {info}", flush=True)
    run.meter.restart()
    return run


# -----------------------------------------------------------------------------
# steps


def train_step(run: Run) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum micro-batches: (mean loss, grad norm) on the device, unsynced, and the lr."""
    cfg = run.cfg
    lr = lr_at(run.step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        last = micro == cfg.grad_accum - 1  # reduce gradients over the processes only on the last micro-step
        if run.sharded:
            run.raw_model.set_requires_gradient_sync(last)
        elif run.world > 1:
            run.model.require_backward_grad_sync = last
        x, y = run.train_loader.next_batch()
        with autocast(cfg.dtype, run.device), sdpa_backend(cfg.attn.sdpa_backend):
            _, loss = run.model(x, y)
        (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over all shards
        grad_norm = grad_norm.full_tensor()
    # a non-finite gradient never reaches the weights: the fused AdamW skips the whole update on
    # the device (no host sync); the loop stops at its next sync point (check_finite)
    bad = ~torch.isfinite(grad_norm)
    run.optimizer.found_inf = bad.float()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.first_bad_step = torch.where(bad & (run.first_bad_step == 0), run.step, run.first_bad_step)
    return loss_sum / cfg.grad_accum, grad_norm, lr


def check_finite(run: Run, loss: float | None = None) -> None:
    """Raises Diverged if a step since the start had a non-finite gradient, or `loss` is not finite."""
    bad_step = int(run.first_bad_step.item())
    if bad_step or (loss is not None and not math.isfinite(loss)):
        what = f"the gradient norm at step {bad_step}" if bad_step else f"the loss at step {run.step}"
        raise Diverged(f"training diverged: {what} is not finite; that update was skipped and the run stopped "
                       f"(optim.lr={run.cfg.optim.lr})")


@torch.no_grad()
def evaluate(run: Run) -> float:
    run.val_loader.load_state_dict(run.val_start)  # the same validation windows every time: comparable across steps
    run.model.eval()
    losses = []
    for _ in range(run.cfg.eval_steps):
        x, y = run.val_loader.next_batch()
        with autocast(run.cfg.dtype, run.device), sdpa_backend(run.cfg.attn.sdpa_backend):
            losses.append(run.model(x, y)[1].float())
    run.model.train()
    loss = torch.stack(losses).mean()
    if run.world > 1:  # each rank saw its slice of the global validation batch
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def save(run: Run) -> None:
    """Checkpoints the run (rank 0; every rank's loader holds the same state, so rank 0's serves all)."""
    check_finite(run)
    state = state_dict(run) if run.master or run.sharded else None  # sharded: every rank gathers
    if run.master:
        save_checkpoint(run.run_dir / CHECKPOINT_NAME, state)
    run.saved_step = run.step


def last_checkpoint(run: Run) -> str:
    if run.saved_step is None:
        return "no checkpoint was written"
    return f"the last checkpoint (step {run.saved_step}) is {run.run_dir / CHECKPOINT_NAME}"


def resume_hint(run: Run) -> str:
    return f"add {shell_override('resume', str(run.run_dir))} to the same command to continue"


# -----------------------------------------------------------------------------
# preemption


class Stopped(Exception):
    """A stop signal arrived while the run was being set up: no step ran, nothing is saved."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step; nothing was saved: "
                         "the same command starts the run again")
        self.signum = signum


class StopSignals:
    """SIGTERM, SIGUSR1 and SIGHUP: what a scheduler sends before it preempts a job (Kubernetes,
    SLURM's --signal, torchrun passing SIGTERM on). During setup they stop the run at once
    (Stopped); in the loop the step in flight finishes, and signum() after it names the signal to
    stop for. Under torchrun the ranks agree: each step all-reduces (MAX) the signal this rank got,
    and signum() answers with the previous step's result, read from pinned memory once that step's
    work is done, so every rank stops after the same step and the host still runs a step ahead."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self):
        self.received = 0
        self.in_loop = False
        self._previous: dict = {}
        self._flag = self._host = self._done = None  # device flag, its host copy, the event after that copy

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signum
        if not self.in_loop:
            raise Stopped(signum)

    def signum(self, run: Run) -> int:
        """After a step: the signal to stop for (the same on every rank), or 0 to go on."""
        if run.world == 1:
            return self.received
        agreed = self.settle()
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=run.device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=run.device.type == "cuda")
        self._flag.fill_(self.received)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True).wait()  # CUDA: the stream waits, not the host
        self._host.copy_(self._flag, non_blocking=True)
        if run.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()
        return agreed

    def settle(self) -> int:
        """The last all-reduced signal (0 if none yet), once it is on the host; after this no
        all-reduce of ours is in flight."""
        if self._host is None:
            return 0
        if self._done is not None:
            self._done.synchronize()
        return int(self._host.item())


# -----------------------------------------------------------------------------
# the loop


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Runs the whole training described by cfg, writing into run_dir; returns the summary."""
    with StopSignals() as stop:  # SIGTERM during setup raises Stopped
        run = setup(cfg, Path(run_dir))
        stop.in_loop = True
        bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not run.master, dynamic_ncols=True,
                   desc=str(cfg.attn.name))
        profiler = Profiler(run.run_dir / "profile", run.device) if cfg.profile and run.master else None
        status, message = "ok", None
        try:
            while run.step < cfg.max_steps:
                step(run, bar)
                if profiler:
                    profiler.step()
                if signum := stop.signum(run):
                    status, message = "stopped", stop_for(run, signum)
                    run.info["signal"] = signal.Signals(signum).name
                    break
        except torch.cuda.OutOfMemoryError:
            if run.world > 1:  # the other ranks wait in an all-reduce: fail this process, torchrun stops them all
                raise
            status = "oom"
            message = (f"CUDA out of memory at step {run.step + 1} with attn={cfg.attn.name} seq_len={cfg.seq_len} "
                       f"batch_size={cfg.batch_size}: lower batch_size or seq_len, or use attn=sdpa/triton")
        except (Diverged, DiskFullError, CheckpointError) as e:
            status, message = ("diverged" if isinstance(e, Diverged) else "failed"), f"{e}; {last_checkpoint(run)}"
        except BaseException as e:  # Ctrl-C or a crash: close the W&B run as failed; ckpt.pt stays the last good one
            if run.master:
                if isinstance(e, KeyboardInterrupt):
                    print(f"\ninterrupted at step {run.step}; {last_checkpoint(run)}: {resume_hint(run)}",
                          file=sys.stderr)
                run.log.run.finish(exit_code=1)
            raise
        finally:
            bar.close()
            if profiler:
                profiler.close()
        stop.settle()
        return finish(run, status, message)


def step(run: Run, bar: tqdm) -> None:
    """One training step, then what falls due after it: a log record, an evaluation, a checkpoint."""
    cfg = run.cfg
    loss, grad_norm, lr = train_step(run)
    run.meter.count_step()
    bar.update(1)
    last = run.step == cfg.max_steps
    if run.step % cfg.log_interval == 0 or last:
        if run.world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        loss_val = loss.item()  # syncs the device: the timing below is honest
        check_finite(run, loss_val)
        rec = run.meter.record(step=run.step, loss=loss_val, lr=lr, grad_norm=grad_norm.item(),
                               attn=str(cfg.attn.name), seq_len=cfg.seq_len)
        if run.master:
            run.log.log(rec)
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}")
    if cfg.eval_steps and ((cfg.eval_interval and run.step % cfg.eval_interval == 0) or last):
        with run.meter.paused():
            run.last_val = evaluate(run)
            if run.sharded:  # a forward without backward leaves the root's weights gathered
                run.raw_model.reshard()
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
    if run.world > 1:
        dist.barrier()  # no rank exits (and has torchrun stop the others) before rank 0's save is whole
    said = f"stopped by {signal.Signals(signum).name} after step {run.step}; {last_checkpoint(run)}"
    if run.saved_step is None:
        return f"{said} (ckpt_interval=-1): the run cannot continue"
    return f"{said}: {resume_hint(run)}"


def finish(run: Run, status: str, message: str | None) -> dict:
    """Writes summary.json and closes the W&B run (rank 0); returns the summary."""
    cfg = run.cfg
    if message and run.master:
        print(message, file=sys.stderr)
        with contextlib.suppress(OSError):  # a full disk said its line already; the record may not fit
            run.log.log({"step": run.step, "event": status, status: 1, "message": message})
    history = run.meter.history
    summary = {"status": status, "message": message, "steps": run.step,
               "best_val_loss": run.best_val if run.last_val is not None else None, "final_val_loss": run.last_val,
               "final_loss": history[-1]["loss"] if history else None, **run.meter.summary(),
               "attn": str(cfg.attn.name), "seq_len": cfg.seq_len, **run.info}
    ok = status == "ok"
    if run.sharded:  # every rank's forward gathers weights with the others: all sample, or none (a rank-0 save failed)
        flag = torch.tensor(int(ok), device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    if ok and cfg.sample_tokens > 0 and (run.master or run.sharded):
        summary["sample"] = sample(run.raw_model, cfg, run.device)
    if run.master:
        if "sample" in summary:
            print(f"--- sample ---\n{summary['sample']}\n--------------")
        with contextlib.suppress(DiskFullError):
            atomic_write(run.run_dir / "summary.json", json_line(summary).encode())
        run.log.finish(summary)
        print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k not in ("sample", "message")))
    if run.world > 1:
        if dist.get_backend() == "gloo":
            # gloo's worker threads free a finished collective's tensors under the GIL; a process group
            # destroyed before that (its destructor joins them with the GIL held) hangs: let them finish
            time.sleep(0.1)
        dist.destroy_process_group()
    return summary


def sample(model: GPT, cfg: DictConfig, device: torch.device) -> str:
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    with autocast(cfg.dtype, device):
        out = model.generate(idx, cfg.sample_tokens, generator=gen)
    return enc.decode(out[0].tolist())


def exit_code(summary: dict) -> int:
    """A stopped run exits as the signal would have ended it (143 for SIGTERM), a failed one 1."""
    if summary["status"] == "stopped":
        return 128 + signal.Signals[summary["signal"]].value
    return 0 if summary["status"] == "ok" else 1


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    try:
        summary = train(cfg, Path(hc.runtime.output_dir))
    except DiskFullError as e:  # preparing data or a cache before training started
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Stopped as e:
        print(e, file=sys.stderr)
        abandon_run_dir(Path(hc.runtime.output_dir))
        sys.exit(128 + e.signum)
    except (ConfigError, DatasetError, CheckpointError) as e:
        if hc.mode == RunMode.RUN:
            print(f"error: {e}", file=sys.stderr)
            abandon_run_dir(Path(hc.runtime.output_dir))
            sys.exit(2)
        # a sweep job that cannot run is recorded with its reason and skipped; the sweep goes on
        print(f"error: {e} (this job is skipped; the sweep goes on)", file=sys.stderr)
        job_dir = Path(hc.runtime.output_dir)
        if not any((job_dir / name).exists() for name in ("summary.json", CHECKPOINT_NAME)):
            atomic_write(job_dir / "summary.json", json_line({"status": "skipped", "message": str(e)}).encode())
        return None
    # a failed sweep job is recorded and the next one runs; a stopped one stops the sweep
    if summary["status"] != "ok" and (hc.mode == RunMode.RUN or summary["status"] == "stopped"):
        sys.exit(exit_code(summary))
    return summary["final_val_loss"]


if __name__ == "__main__":
    sys.argv[1:] = quoted_where_needed(sys.argv[1:])  # any path as typed: hydra.run.dir=/data/ü_日本
    if int(os.environ.get("RANK", "0")) > 0:
        # under torchrun rank 0 alone owns the Hydra run dir; the other ranks get none and write nothing
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled"]
    else:
        sys.argv += preflight(sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # train() said where to resume
