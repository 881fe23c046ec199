"""Trains the GPT with the attention picked by `attn=`; logs to W&B (offline by default) and metrics.jsonl.

    python train.py                                   # tiny model, Shakespeare, SDPA
    python train.py experiment=gpt2_16k attn=triton seq_len=8192
    python train.py -m attn=naive,sdpa,triton seq_len=512,1024
    torchrun --standalone --nproc_per_node=2 train.py attn=triton

`main` is the Hydra entry point; `train(cfg, run_dir)` does the work and is what tests call.
"""

import importlib.metadata
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from configs.schema import register_configs
from data import DatasetError, TokenWindows, get_encoding
from data.prepare import prepare
from model import GPT
from model.attention import get_attention, get_sdpa_backend, sdpa_backend_in_use

register_configs()

# dense bf16 tensor-core peak by datasheet, for MFU; substrings of torch.cuda.get_device_name()
GPU_PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12,
                       "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12,
                       "RTX 4090": 165e12, "RTX 3090": 71e12}


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


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


def make_optimizer(model: torch.nn.Module, cfg: DictConfig, device: torch.device) -> torch.optim.AdamW:
    # decay matmul weights and embeddings (>= 2-D); never biases or LayerNorm gains
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             eps=cfg.optim.eps, fused=device.type == "cuda")


def save_checkpoint(path: Path, state: dict) -> None:
    # write then rename: a crash or Ctrl-C mid-save leaves the previous checkpoint intact
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(resume: str, cfg: DictConfig) -> tuple[Path, dict]:
    path = Path(hydra.utils.to_absolute_path(resume))
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no checkpoint at {path}; pass a run dir holding ckpt.pt or a .pt file")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    want, have = OmegaConf.to_container(cfg.model, resolve=True), ckpt["config"]["model"]
    if want != have:
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        raise ConfigError(f"checkpoint {path} has another model shape {{key: (checkpoint, this run)}} {diff}: "
                          "resume with the overrides the run was started with (see its .hydra/overrides.yaml)")
    return path.parent, ckpt


def check_config(cfg: DictConfig, world: int) -> None:
    if cfg.batch_tokens is not None:  # tokens per micro-step over all processes
        if cfg.batch_tokens % (cfg.seq_len * world):
            raise ConfigError(f"batch_tokens {cfg.batch_tokens} does not split into sequences of {cfg.seq_len} "
                              f"over {world} processes: make it a multiple of seq_len x world size")
        cfg.batch_size = cfg.batch_tokens // (cfg.seq_len * world)
    if cfg.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {cfg.model.max_seq_len}: "
                          "set model.max_seq_len or a smaller seq_len")
    try:
        get_attention(cfg.attn.name)
        if cfg.attn.sdpa_backend is not None:
            get_sdpa_backend(cfg.attn.sdpa_backend)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.model.d_model % cfg.model.n_head:
        raise ConfigError(f"model.d_model {cfg.model.d_model} is not divisible by model.n_head {cfg.model.n_head}")
    if cfg.model.pos_emb not in ("learned", "rope"):
        raise ConfigError(f"model.pos_emb {cfg.model.pos_emb!r}: choose learned or rope")
    if cfg.attn.name == "triton" and cfg.model.d_model // cfg.model.n_head > 256:
        raise ConfigError(f"attn=triton supports head dims up to 256, this model has "
                          f"{cfg.model.d_model // cfg.model.n_head}: use more heads or attn=sdpa")
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype {cfg.dtype!r}: choose auto, float32 or bfloat16")


def setup_distributed(cfg: DictConfig) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); one process per GPU under torchrun, else a single process."""
    if "RANK" not in os.environ:
        if cfg.device == "auto":
            return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, torch.device(cfg.device)
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    use_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} needs GPU {local_rank}, but only "
                          f"{torch.cuda.device_count()} are visible: lower --nproc_per_node")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return rank, world, device


class RunLog:
    """Rank 0's metrics sinks: metrics.jsonl in the run dir and the W&B run."""

    def __init__(self, run_dir: Path, cfg: DictConfig, wandb_id: str | None, resume_step: int | None):
        import wandb  # imported here: slow to import, and only rank 0 logs

        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # keep the curve single-valued: drop what the interrupted run logged past its checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if json.loads(ln).get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)
        group = cfg.wandb.group
        if group is None and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            group = "sweep-" + Path(HydraConfig.get().sweep.dir).as_posix().replace("/", "_")
        self.run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, group=group,
                              name=cfg.wandb.name or f"{cfg.attn.name}-T{cfg.seq_len}-{cfg.model.name}",
                              tags=list(cfg.wandb.tags), mode=cfg.wandb.mode, dir=str(run_dir),
                              config=OmegaConf.to_container(cfg, resolve=True),
                              id=wandb_id, resume="allow" if wandb_id else None)

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary["status"] == "ok" else 1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TokenWindows, start: dict, steps: int, autocast, world: int) -> float:
    loader.load_state_dict(start)  # the same validation windows every time: comparable across steps
    model.eval()
    losses = []
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            losses.append(model(x, y)[1].float())
    model.train()
    loss = torch.stack(losses).mean()
    if world > 1:  # each rank saw its slice of the global validation batch
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


# -----------------------------------------------------------------------------
# training


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Runs the whole training described by cfg, writing into run_dir; returns the summary."""
    rank, world, device = setup_distributed(cfg)
    check_config(cfg, world)
    master = rank == 0  # rank 0 alone writes: run dir, metrics, W&B, checkpoints, progress bar
    run_dir = Path(run_dir)

    resume_step, ckpt = None, None
    if cfg.resume:
        run_dir, ckpt = load_checkpoint(cfg.resume, cfg)  # continue in the original run's directory
        resume_step = ckpt["step"]
        if resume_step >= cfg.max_steps:
            raise ConfigError(f"resume={cfg.resume}: that run already finished at step {resume_step}; "
                              f"raise max_steps above {resume_step} to train it further")
        if master:
            print(f"resuming {run_dir} at step {resume_step}: metrics, W&B and checkpoints continue there")
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # a sweep runs its jobs in one process: start this job's memory peaks from its own baseline
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    # ---- data: one process per node prepares on first use; the others wait, then find it ready
    local_master = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if local_master:
        dataset_dir = prepare(cfg.data)
    if world > 1:
        dist.barrier()
    if not local_master:
        dataset_dir = prepare(cfg.data)
    # each rank takes its own slice of one global batch (data/loader.py)
    data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    train_loader = TokenWindows(dataset_dir, "train", cfg.seq_len, cfg.batch_size, device, data_seed, rank, world)
    val_loader = TokenWindows(dataset_dir, "val", cfg.seq_len, cfg.batch_size, device, cfg.seed, rank, world)
    val_start = val_loader.state_dict()

    # ---- model and optimizer
    model = GPT(cfg.model, cfg.attn.name).to(device)
    optimizer = make_optimizer(model, cfg, device)
    step, best_val = 0, float("inf")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"])
        step, best_val = ckpt["step"], ckpt["best_val_loss"]
        torch.set_rng_state(ckpt["rng"]["cpu"])
        if device.type == "cuda" and ckpt["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    if world > 1:
        torch.manual_seed(cfg.seed + rank)  # same initial weights everywhere, but each rank its own dropout
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        # gradients live in the all-reduce buckets: no copy in and out of them after backward
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)

    sdpa_ctx = nullcontext()
    if cfg.attn.sdpa_backend is not None:
        from torch.nn.attention import sdpa_kernel

        sdpa_ctx = sdpa_kernel(get_sdpa_backend(cfg.attn.sdpa_backend))

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
    flops_per_token = raw_model.flops_per_token(cfg.seq_len)
    peak_flops = gpu_peak_flops(device)
    info = {"params": raw_model.num_params(), "tokens_per_step": tokens_per_step, "world_size": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version()}
    if cfg.attn.name == "sdpa" and device.type == "cuda":
        H, D = cfg.model.n_head, cfg.model.d_model // cfg.model.n_head
        # laid out as the model passes them: strided views of one (B, T, 3, H, D) projection
        qkv = torch.empty(cfg.batch_size, cfg.seq_len, 3, H, D, device=device,
                          dtype=torch.bfloat16 if use_bf16 else torch.float32)
        with sdpa_ctx:
            info["sdpa_backend"] = sdpa_backend_in_use(*qkv.permute(2, 0, 3, 1, 4))

    log = None
    if master:
        log = RunLog(run_dir, cfg, ckpt["wandb_id"] if ckpt else None, resume_step)
        log.run.config.update(info, allow_val_change=True)
        print(f"run dir {run_dir} | {info}", flush=True)

    # ---- the loop
    status, last_val, history = "ok", None, []
    mem_peaks = {"peak_mem_alloc_gib": None, "peak_mem_reserved_gib": None}  # GPU only
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not master, dynamic_ncols=True, desc=cfg.attn.name)
    t_last, tokens_since = time.perf_counter(), 0
    try:
        with sdpa_ctx:
            while step < cfg.max_steps:
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                for micro in range(cfg.grad_accum):
                    if world > 1:  # all-reduce gradients only on the last micro-step
                        model.require_backward_grad_sync = micro == cfg.grad_accum - 1
                    x, y = train_loader.next_batch()
                    with autocast:
                        _, loss = model(x, y)
                    (loss / cfg.grad_accum).backward()
                    loss_sum += loss.detach()
                clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens_since += tokens_per_step
                bar.update(1)

                last = step == cfg.max_steps
                if step % cfg.log_interval == 0 or last:
                    loss_avg = loss_sum / cfg.grad_accum
                    if world > 1:
                        dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                    loss_val = loss_avg.item()  # syncs the device: the timing below is honest
                    if not math.isfinite(loss_val):
                        raise FloatingPointError(f"loss is {loss_val} at step {step}: lower optim.lr or check data")
                    dt = time.perf_counter() - t_last
                    tok_s = tokens_since / dt
                    rec = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm.item(),
                           "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
                           "mfu": flops_per_token * tok_s / (peak_flops * world) if peak_flops else None,
                           "attn": cfg.attn.name, "seq_len": cfg.seq_len, **memory_since_last_log(device, world)}
                    for k in mem_peaks:
                        if rec[k] is not None:
                            mem_peaks[k] = max(mem_peaks[k] or 0.0, rec[k])
                    history.append(rec)
                    if master:
                        log.log(rec)
                        bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tok_s:,.0f}")
                    t_last, tokens_since = time.perf_counter(), 0

                if (cfg.eval_interval and step % cfg.eval_interval == 0) or last:
                    last_val = evaluate(model, val_loader, val_start, cfg.eval_steps, autocast, world)
                    best_val = min(best_val, last_val)
                    if master:
                        log.log({"step": step, "val_loss": last_val})
                        bar.write(f"step {step}: val loss {last_val:.4f}")
                    t_last, tokens_since = time.perf_counter(), 0  # evaluation is not training throughput
                due = cfg.ckpt_interval >= 0 and ((cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or last)
                if master and due:  # every rank's loader holds the same state: rank 0's serves all
                    save_checkpoint(run_dir / "ckpt.pt", {
                        "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "config": OmegaConf.to_container(cfg, resolve=True), "best_val_loss": best_val,
                        "loader": train_loader.state_dict(), "wandb_id": log.run.id,
                        "rng": {"cpu": torch.get_rng_state(),
                                "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}})
                    t_last, tokens_since = time.perf_counter(), 0  # saving is not training throughput
    except torch.cuda.OutOfMemoryError:
        status = "oom"
        msg = (f"CUDA out of memory at step {step + 1} with attn={cfg.attn.name} seq_len={cfg.seq_len} "
               f"batch_size={cfg.batch_size}: lower batch_size or seq_len, or use attn=sdpa/triton")
        if master:
            bar.write(msg)
            log.log({"step": step, "event": "oom", "oom": 1, "message": msg})
        if world > 1:  # the other ranks wait in an all-reduce: fail this process, torchrun stops them all
            raise
    except BaseException:  # Ctrl-C or a crash: close the W&B run as failed; ckpt.pt stays the last good one
        if master:
            log.run.finish(exit_code=1)
        raise
    finally:
        bar.close()

    steady = history[1:] or history  # the first interval includes warmup and compilation
    summary = {"status": status, "steps": step, "best_val_loss": best_val if last_val is not None else None,
               "final_val_loss": last_val, "final_loss": history[-1]["loss"] if history else None,
               "mean_tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None,
               "attn": cfg.attn.name, "seq_len": cfg.seq_len, **mem_peaks, **info}
    if master:
        if status == "ok" and cfg.sample_tokens > 0:
            summary["sample"] = sample(raw_model, cfg, device, autocast)
            print(f"--- sample ---\n{summary['sample']}\n--------------")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.finish(summary)
        print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "sample"))
    if world > 1:
        dist.destroy_process_group()
    return summary


def memory_since_last_log(device: torch.device, world: int) -> dict:
    """Peak allocated/reserved GiB since the previous call (max over ranks); None on CPU."""
    if device.type != "cuda":
        return {"peak_mem_alloc_gib": None, "peak_mem_reserved_gib": None}
    peaks = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                         dtype=torch.float64, device=device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    if world > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {"peak_mem_alloc_gib": peaks[0].item(), "peak_mem_reserved_gib": peaks[1].item()}


def sample(model: GPT, cfg: DictConfig, device: torch.device, autocast) -> str:
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    with autocast:
        out = model.generate(idx, cfg.sample_tokens, generator=gen)
    return enc.decode(out[0].tolist())


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    try:
        summary = train(cfg, Path(hc.runtime.output_dir))
    except (ConfigError, DatasetError) as e:
        if hc.mode == RunMode.RUN:
            sys.exit(f"error: {e}")
        print(f"error: {e} (this job is skipped; the sweep goes on)", file=sys.stderr)
        return None
    if summary["status"] != "ok" and hc.mode == RunMode.RUN:
        sys.exit(1)  # in a sweep the failure is recorded and the next job runs
    return summary["final_val_loss"]


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:
        # under torchrun rank 0 alone owns the Hydra run dir; the other ranks get none and write nothing
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled"]
    main()
