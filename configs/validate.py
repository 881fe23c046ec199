"""Checks a composed training config before anything runs, and what a resume may change.

The schema (configs/schema.py) already fixed every key's type and choices; here are the rules
that need a value range, several keys, or this machine. Each failure is a ConfigError whose one
line names the key, the value and what is allowed.
"""

import math
import os
import re
from dataclasses import MISSING, fields
from enum import Enum

from omegaconf import MISSING as OMEGACONF_MISSING
import torch
from omegaconf import DictConfig, OmegaConf

from configs.runtime import autocast_dtype, resolve_device, wandb_mode
from configs.schema import AttnConfig, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, WandbConfig
from data.tokenizer import VOCAB_SIZE
from kernels import unsupported
from model.attention import ATTENTIONS, MODS, Modifications, get_attention


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def _fail(key: str, value, allowed: str):
    raise ConfigError(f"{key}={value}: {allowed}")


def launch_env() -> dict[str, int]:
    """torchrun's variables of this process (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), each
    checked, with a process of its own's values where unset; ConfigError naming one that is not a
    count, out of range, or RANK without WORLD_SIZE and LOCAL_RANK."""
    env = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}
    for key, low in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        if key in os.environ:
            text = os.environ[key]
            if not (text.isdigit() and int(text) >= low):
                _fail(key, text, f"must be an integer >= {low} (torchrun sets it): launch with torchrun, or unset it")
            env[key] = int(text)
    if "RANK" in os.environ and not {"WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys():
        _fail("RANK", os.environ["RANK"], "comes with WORLD_SIZE and LOCAL_RANK (torchrun sets all three): launch with "
                                          "torchrun, or unset RANK")
    if env["RANK"] >= env["WORLD_SIZE"]:
        _fail("RANK", env["RANK"], f"must be below WORLD_SIZE {env['WORLD_SIZE']}")
    return env


def _at_least(cfg: DictConfig, keys: str, low: int) -> None:
    for key in keys.split():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < low:
            _fail(key, value, f"must be at least {low}")


def _within(cfg: DictConfig, key: str, low: float, high: float, closed_high: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if not (math.isfinite(value) and low <= value and (value <= high if closed_high else value < high)):
        _fail(key, value, f"must be in [{low:g}, {high:g}{']' if closed_high else ')'}")


def _int64(cfg: DictConfig, prefix: str = "") -> None:
    """Integers fit torch's int64 (a seed of 10**20 would fail deep in torch.manual_seed)."""
    for key, value in cfg.items():
        if isinstance(value, DictConfig):
            _int64(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            _fail(f"{prefix}{key}", value, "must be below 2**63")


def validate(cfg: DictConfig, world: int = 1) -> None:
    """Raises ConfigError for the first key whose value cannot run; world is the process count."""
    m = cfg.model
    _int64(cfg)
    _at_least(cfg, "seq_len batch_size grad_accum max_steps log_interval model.n_layer model.n_head model.d_model "
                   "model.max_seq_len model.loss_chunk batch_tokens parallel.cp parallel.cp_head_groups", 1)
    _at_least(cfg, "eval_interval eval_steps optim.warmup_steps sample_tokens model.mlp_chunk model.n_kv_head "
                   "attn.window attn.window_warmup attn.prefix", 0)
    _at_least(cfg, "ckpt_interval", -1)
    _at_least(cfg, "seed data_seed", 0)
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        _fail("device", cfg.device, str(e))
    _parallel(cfg, world)  # first: the GPU a process would use exists (the dtype check reads it)
    try:  # bfloat16 and float16 run on the CPU too (autocast there has both): the tests train in each
        autocast_dtype(cfg.dtype, device)
    except ValueError as e:
        _fail("dtype", cfg.dtype, str(e))
    dp = data_parallel_size(cfg, world)
    if cfg.batch_tokens is not None and cfg.batch_tokens % (cfg.seq_len * dp):
        _fail("batch_tokens", cfg.batch_tokens, f"must be a multiple of seq_len x data-parallel processes = "
                                                f"{cfg.seq_len} x {dp}")
    if cfg.seq_len > m.max_seq_len:
        _fail("seq_len", cfg.seq_len, f"must not exceed model.max_seq_len {m.max_seq_len}: set model.max_seq_len too")
    if cfg.attn.window >= cfg.seq_len:
        _fail("attn.window", cfg.attn.window, f"must be below seq_len {cfg.seq_len}: a window of as many keys as a "
                                             "training sequence masks nothing; 0 is plain causal attention")
    _windows_and_mods(cfg)
    if m.vocab_size < VOCAB_SIZE:
        _fail("model.vocab_size", m.vocab_size, f"must be at least the GPT-2 tokenizer's {VOCAB_SIZE}")
    if m.d_model % m.n_head:
        _fail("model.d_model", m.d_model, f"must be divisible by model.n_head {m.n_head}")
    if m.n_kv_head and m.n_head % m.n_kv_head:
        _fail("model.n_kv_head", m.n_kv_head, f"must divide model.n_head {m.n_head} (or be 0: as many as n_head)")
    head_dim = m.d_model // m.n_head
    attention = ATTENTIONS[cfg.attn.name]
    if attention.max_head_dim is not None and head_dim > attention.max_head_dim:
        _fail("model.d_model", m.d_model, f"gives head dim {head_dim} with {m.n_head} heads; attn={attention.name} "
                                          f"supports up to {attention.max_head_dim}: use more heads or attn=sdpa")
    if attention.unsupported is not None:  # what this machine cannot run: before anything is created
        why = attention.unsupported(head_dim, autocast_dtype(cfg.dtype, device) or torch.float32, device)
        if why:
            _fail("attn", attention.name, f"cannot run here: {why}; use attn=sdpa")
    try:
        get_attention(cfg.attn.name, cfg.attn.backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.attn.backend == "gluon":
        why = unsupported(head_dim, autocast_dtype(cfg.dtype, device) or torch.float32, device, "gluon")
        if why:
            _fail("attn.backend", "gluon", f"the Hopper kernels cannot run here: {why}; use auto or triton")
    if m.pos_emb == "rope" and head_dim % 2:
        _fail("model.d_model", m.d_model, f"gives odd head dim {head_dim}; RoPE rotates pairs: use an even one")
    if not (math.isfinite(m.rope_theta) and m.rope_theta > 0):
        _fail("model.rope_theta", m.rope_theta, "must be a positive number")
    _within(cfg, "model.dropout", 0, 1)
    _within(cfg, "model.z_loss", 0, math.inf)
    o = cfg.optim
    if not (math.isfinite(o.lr) and o.lr > 0):
        _fail("optim.lr", o.lr, "must be a positive number")
    if not (math.isfinite(o.eps) and o.eps > 0):
        _fail("optim.eps", o.eps, "must be a positive number")
    _within(cfg, "optim.min_lr_ratio", 0, 1, closed_high=True)
    _within(cfg, "optim.beta1", 0, 1)
    _within(cfg, "optim.beta2", 0, 1)
    _within(cfg, "optim.weight_decay", 0, math.inf)
    _within(cfg, "optim.grad_clip", 0, math.inf)
    validate_data(cfg)
    if device.type == "cpu":
        _fits_cpu_memory(cfg, world)
    if cfg.compile_mode != "default" and not (cfg.compile and device.type == "cuda"):
        _fail("compile_mode", cfg.compile_mode, "needs compile=true on a CUDA device (CUDA graphs): add compile=true, "
                                                "or leave compile_mode=default")
    if cfg.profile and cfg.max_steps < 5:
        _fail("max_steps", cfg.max_steps, "must be at least 5 with profile=true (it records steps 3-5)")
    if cfg.sample_tokens and not cfg.sample_prompt:
        _fail("sample_prompt", "''", "must not be empty when sample_tokens > 0")
    if not cfg.wandb.project:
        _fail("wandb.project", "''", "must not be empty")
    try:
        wandb_mode(cfg.wandb.mode)
    except ValueError as e:
        _fail("WANDB_MODE", os.environ["WANDB_MODE"], f"{e} (read from the environment, as wandb.mode is not set)")


def _fits_cpu_memory(cfg: DictConfig, world: int) -> None:
    """A batch that cannot fit in this machine's memory is refused before anything is made. The
    bound is one no run beats: a micro-step keeps each block's input for the backward (2 bytes a
    number at least) and the loader's int64 windows (32 bytes a token), in each process here."""
    tokens = batch_size_per_process(cfg, world) * cfg.seq_len
    need = tokens * (32 + 2 * cfg.model.d_model * cfg.model.n_layer) * launch_env()["LOCAL_WORLD_SIZE"]
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        key = "batch_size" if cfg.batch_tokens is None else "batch_tokens"
        _fail(key, cfg[key], f"with seq_len {cfg.seq_len}, a micro-step of {tokens:,} tokens needs {need / 2**30:,.0f} "
                             f"GiB of memory at least, and this machine has {have / 2**30:,.1f} GiB: lower {key} "
                             "(grad_accum adds steps, not memory)")


def validate_data(cfg: DictConfig) -> None:
    """The data.* rules; cfg may hold the data group alone (scripts/prepare_data.py)."""
    _at_least(cfg, "data.max_docs", 1)
    d = cfg.data
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", d.name) or d.name in (".", ".."):
        _fail("data.name", d.name, "must be a plain directory name (letters, digits, _ . -)")
    if d.source == "hf" and not d.hf_path:
        _fail("data.hf_path", d.hf_path, "a Hugging Face dataset name is needed with data.source=hf")
    _within(cfg, "data.val_fraction", 0, 1)
    if d.val_fraction == 0:
        _fail("data.val_fraction", d.val_fraction, "must be above 0: validation needs documents")


def _parallel(cfg: DictConfig, world: int) -> None:
    local_rank = launch_env()["LOCAL_RANK"]
    if resolve_device(cfg.device).type == "cuda" and local_rank >= torch.cuda.device_count():
        _fail("LOCAL_RANK", local_rank, f"needs GPU {local_rank}, but only {torch.cuda.device_count()} are visible: "
                                        "lower --nproc_per_node")
    if cfg.parallel.dp == "fsdp" and "RANK" not in os.environ:
        _fail("parallel.dp", "fsdp", "shards the model over torchrun's processes: launch with torchrun "
                                     "(--nproc_per_node=1 on one GPU)")
    if cfg.parallel.dp != "fsdp":  # DDP keeps fp32 weights whole; autocast casts them per use
        for key in FSDP_ONLY:
            name = key.removeprefix("parallel.")
            if cfg.parallel[name] != getattr(ParallelConfig(), name):
                _fail(key, cfg.parallel[name], "sets how FSDP gathers weights: add parallel.dp=fsdp, or drop it")
    if cfg.parallel.unit_params < 1:
        _fail("parallel.unit_params", cfg.parallel.unit_params, "must be at least 1 (1: each block its own FSDP unit)")
    cp = cfg.parallel.cp
    if world % cp:
        _fail("parallel.cp", cp, f"must divide the number of processes, {world}: run under torchrun "
                                 f"--nproc_per_node=<a multiple of {cp}>")
    method = ATTENTIONS[cfg.attn.name].context_parallel
    torch_cp = ", ".join(f"attn={a.name}" for a in ATTENTIONS.values() if a.context_parallel == "torch")
    if cfg.parallel.cp_rotate is not None and method != "torch":
        _fail("parallel.cp_rotate", cfg.parallel.cp_rotate, f"is how torch's context parallelism ({torch_cp}) passes "
                                                            f"K/V; attn={cfg.attn.name} does not use it: drop it")
    if cfg.parallel.cp_rotate is not None and cp == 1:
        _fail("parallel.cp_rotate", cfg.parallel.cp_rotate, "is how the ranks of a split sequence pass K/V: add "
                                                            "parallel.cp=N (N > 1), or drop it")
    groups, kv_heads = cfg.parallel.cp_head_groups, cfg.model.n_kv_head or cfg.model.n_head
    ring_needed = ("is how our ring attention splits its heads: it needs attn=triton and parallel.cp=N (N > 1); "
                   "drop it, or set it to 1")
    if groups > 1 and cp == 1:
        _fail("parallel.cp_head_groups", groups, ring_needed)
    if cp == 1:
        return
    if not method:
        able = ", ".join(f"attn={a.name}" for a in ATTENTIONS.values() if a.context_parallel)
        _fail("parallel.cp", cp, f"needs {able} (ring attention over its kernels); attn={cfg.attn.name} "
                                 "cannot split a sequence over ranks")
    if groups > 1 and method != "ring":
        _fail("parallel.cp_head_groups", groups, ring_needed)
    if kv_heads % groups:
        _fail("parallel.cp_head_groups", groups, f"must divide the model's {kv_heads} K/V heads (model.n_kv_head, "
                                                 "or model.n_head)")
    if cfg.seq_len % (2 * cp):
        _fail("seq_len", cfg.seq_len, f"must be a multiple of 2 x parallel.cp = {2 * cp}: each rank holds two "
                                      "equal chunks of every sequence (zigzag)")
    if cfg.data.doc_mask:
        _fail("data.doc_mask", True, "is not supported with parallel.cp > 1 (the ring does not mask documents): "
                                     "drop one of them")
    if cfg.attn.window:
        _fail("attn.window", cfg.attn.window, "is not supported with parallel.cp > 1 (the ring does not window its "
                                              "keys): use attn.window=0 or parallel.cp=1")
    if cfg.model.window_pattern:
        _fail("model.window_pattern", list(cfg.model.window_pattern), "is not supported with parallel.cp > 1 (the "
                                                                       "ring does not window its keys): drop it")
    for name in (name for name in MODS if cfg.attn[name]):
        _fail(f"attn.{name}", cfg.attn[name], "is not supported with parallel.cp > 1 (the ring and torch's context "
                                     "parallelism attend without it): drop it, or use parallel.cp=1")
    if method == "torch" and resolve_device(cfg.device).type != "cuda":
        _fail("parallel.cp", cp, f"with attn={cfg.attn.name} is torch's context parallelism, which runs SDPA's CUDA "
                                 "kernels only (flash, efficient, cuDNN): use a CUDA device, or attn=triton")
    if method == "torch" and cfg.attn.sdpa_backend == "math":
        _fail("attn.sdpa_backend", "math", "has no ring in torch's context parallelism: choose flash, efficient, "
                                          "cudnn or null with parallel.cp > 1")


def _windows_and_mods(cfg: DictConfig) -> None:
    """The per-layer windows, their warm-up and the ablations' modifications: in range, and ones
    the attention computes (model/attention.py's registry says which)."""
    pattern, a = list(cfg.model.window_pattern), cfg.attn
    if pattern and a.window:
        _fail("model.window_pattern", pattern,
              f"sets every layer's window: drop attn.window={a.window}, or the pattern")
    if pattern and not 1 <= len(pattern) <= cfg.model.n_layer:
        _fail("model.window_pattern", pattern, f"needs 1 to model.n_layer = {cfg.model.n_layer} windows, repeating "
                                               "over the layers")
    for w in pattern:
        if not 0 <= w < cfg.seq_len:
            _fail("model.window_pattern", pattern, f"windows must be 0 (global) or in [1, seq_len = {cfg.seq_len})")
    if a.window_warmup and not (a.window or any(pattern)):
        _fail("attn.window_warmup", a.window_warmup, "warms up sliding windows: set attn.window or "
                                                     "model.window_pattern, or drop it")
    if not (math.isfinite(a.softcap) and a.softcap >= 0):
        _fail("attn.softcap", a.softcap, "must be a finite number > 0, or 0 for none")
    if a.prefix >= cfg.seq_len:
        _fail("attn.prefix", a.prefix, f"must be below seq_len {cfg.seq_len}: a prefix of the whole sequence "
                                       "leaves no token to predict")
    attention = ATTENTIONS[a.name]
    for name, value in Modifications.of(a).on().items():
        if why := attention.refusal(name):
            _fail(f"attn.{name}", value, why)
        if a.backend == "gluon" and name in ("softcap", "alibi", "prefix"):
            _fail(f"attn.{name}", value, "the Hopper kernels (attn.backend=gluon) do not compute it: use "
                                         "attn.backend=auto or triton, which run the portable kernels")


def data_parallel_size(cfg: DictConfig, world: int) -> int:
    """Processes that each train on their own sequences: the parallel.cp ranks of a group share theirs."""
    return world // cfg.parallel.cp


def batch_size_per_process(cfg: DictConfig, world: int) -> int:
    """Sequences per micro-step per process: batch_tokens spread over the data-parallel processes, if
    it is set."""
    dp = data_parallel_size(cfg, world)
    return cfg.batch_size if cfg.batch_tokens is None else cfg.batch_tokens // (cfg.seq_len * dp)


# what a resume may change: the keys that leave it the same run. Every other key would make another
# one: the model, the data and its document mask, attn.window, seq_len, the global batch, the seeds,
# dtype, AdamW's other constants, and parallel.dp (FSDP's checkpoints key the optimizer state by
# parameter name, DDP's by number).
RESUMABLE = frozenset({
    # how long it runs, what it reports and samples at the end (model.name: a label of the shape)
    "max_steps", "log_interval", "eval_interval", "eval_steps", "ckpt_interval", "sample_tokens", "sample_prompt",
    "profile", "resume", "model.name", "wandb.project", "wandb.mode", "wandb.entity", "wandb.group", "wandb.name",
    "wandb.tags",
    # the same function on the same batches, computed elsewhere or otherwise: other kernels, other rounding
    # (data.cycle changes only windows longer than their split, which fail without it)
    "device", "compile", "compile_mode", "ac", "attn.name", "attn.sdpa_backend", "attn.backend", "model.loss",
    "model.loss_chunk", "model.mlp_chunk", "parallel.cp", "parallel.param_dtype", "parallel.reshard_after_forward",
    "parallel.unit_params", "parallel.cp_rotate", "parallel.cp_head_groups", "data.root", "data.cycle",
    # the lr schedule, which depends on max_steps anyway
    "optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.grad_clip"})


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# how FSDP gathers weights: refused without parallel.dp=fsdp, and no change to a DDP run
FSDP_ONLY = ("parallel.param_dtype", "parallel.reshard_after_forward", "parallel.unit_params")
# what a run ran with before its key existed, where the key's default is otherwise: FSDP gathered
# each block alone before parallel.unit_params
_BEFORE_THE_KEY = {"parallel.unit_params": 1}


def _schema_defaults() -> dict:
    """Every key's default, flat: what a checkpoint written before the key existed ran with."""
    groups = {"attn": AttnConfig, "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "wandb": WandbConfig,
              "parallel": ParallelConfig}
    flat = {}
    for prefix, cls in (("", TrainConfig), *((f"{g}.", c) for g, c in groups.items())):
        for f in fields(cls):
            value = f.default_factory() if f.default_factory is not MISSING else f.default
            if f.name not in groups and value not in (MISSING, OMEGACONF_MISSING):
                flat[prefix + f.name] = value.value if isinstance(value, Enum) else value
    return flat


def check_resume(ckpt: dict, now: dict, dp: int, path) -> str:
    """The settings that differ between a checkpoint and this run (dp data-parallel processes), as
    'key old -> new, ...' (empty if none); ConfigError if one of them would not continue the same run."""
    before, after = {**_schema_defaults(), **_BEFORE_THE_KEY, **_flat(ckpt["config"])}, _flat(now)
    # the batch is global: batch_size is per data-parallel process, batch_tokens a way to set it
    for flat, ranks in ((before, ckpt.get("data_parallel", ckpt["world_size"])), (after, dp)):
        flat["global batch_size"] = flat.pop("batch_size") * ranks
        flat.pop("batch_tokens")
    unknown = sorted(set(before) - set(after))
    if unknown:
        raise ConfigError(f"resume={path}: the checkpoint's config has keys this version does not know "
                          f"({', '.join(unknown[:3])}): resume it with the version of flash-gpt that wrote it")
    changed = {k: (before.get(k), after[k]) for k in sorted(after) if before.get(k) != after[k]
               and (k not in FSDP_ONLY or str(after["parallel.dp"]) == "fsdp")}
    refused = {k: v for k, v in changed.items() if k not in RESUMABLE}
    text = lambda d: ", ".join(f"{k} {old} -> {new}" for k, (old, new) in d.items())
    if refused:
        raise ConfigError(f"resume={path}: {text(refused)} would not continue the same run (model, data, attention "
                          f"window, batch, seeds and precision must match the checkpoint's): drop those overrides, or "
                          f"start a new run; may change on resume: {', '.join(sorted(RESUMABLE))}")
    return text({k: v for k, v in changed.items() if k != "resume"})
