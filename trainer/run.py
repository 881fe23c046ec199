"""What a run is, and how it starts.

setup() checks the config, lays the job out over its processes, claims the run dir, prepares the
data, builds the model, its optimizer and the loaders, resumes from a checkpoint where asked
(trainer/checkpoint.py's state_dict and load_state_dict are everything one holds) and opens the
run's log. run_info() is what the run says it is: its log line, W&B's config and summary.json.
"""

import importlib.metadata
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.runtime import (autocast_dtype, fsdp_param_dtype, grad_scaler, out_of_memory, precision, precision_line,
                             probe_sdpa_backend, resolve_device)
from configs.validate import ConfigError, batch_size_per_process, launch_env, validate
from data import TokenWindows, get_encoding
from data.prepare import prepare_on_node
from kernels.backends import backends as attention_backends
from model import GPT, get_attention
from model.attention import Modifications, sdpa_masked
from trainer.checkpoint import load_state_dict
from trainer.metrics import read_metrics
from trainer.optim import make_optimizer
from trainer.parallel import Parallel
from trainer.report import Meter, RunLog
from trainer.rundir import claim_run_dir, resume_point


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


def recorded_end(run: Run) -> None:
    """A run resumed at its last step only finishes (summary, sample, W&B): its last losses and its
    throughput come from its metrics.jsonl."""
    records = read_metrics(run.run_dir / "metrics.jsonl")
    run.meter.restore([r for r in records if "loss" in r])
    run.last_val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)


def build_model(cfg: DictConfig, par: Parallel) -> GPT:
    """The GPT on this process's device, with the attention the layout calls (the ring under cp)."""
    try:
        attention = par.attention(get_attention(cfg.attn.name, cfg.attn.backend), cfg.parallel.cp_head_groups)
        return GPT(cfg.model, attention, cfg.ac, cfg.attn.window, Modifications.of(cfg.attn)).to(par.device)
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


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # attn=naive/sdpa run without it
        return "not installed"
