"""Checkpoint files: written atomically with a checksum of everything they hold, verified on load.

A checkpoint is one torch.save'd dict (load it with torch.load(path, weights_only=True)) holding
KEYS (state_dict below), "format_version" and a "sha256" entry: the digest of every other
entry, tensors by their bytes, other values by their repr, in key order. A crash or kill -9
mid-save leaves the previous file (data/files.py); a block zeroed or flipped afterwards (what a
power loss or a bad disk leaves) fails the digest or the unpickling, and a file of another format
or with other keys is not one to resume from: load_checkpoint refuses each in one line.

A sharded run's (parallel.dp=fsdp) ckpt.pt holds no weights or optimizer state: its "shards" entry
names the directory of shards that every process wrote in parallel, with their digests
(trainer/shards.py), and any number of processes load them. scripts/export_checkpoint.py makes one
file of it; scripts/sample.py reads either.
"""

import hashlib
import warnings
from pathlib import Path

import torch

from configs.schema import plain
from data.files import atomic_write
from trainer.shards import ShardError, load_shards, non_finite_shards, remove_other_shards, save_shards, verify_shards

CHECKPOINT_NAME = "ckpt.pt"
FORMAT_VERSION = 3  # bumped when KEYS or what they hold change; files without the field are format 1
KEYS = ("step", "model", "optimizer", "loader", "best_val_loss", "rng", "config", "world_size", "data_parallel",
        "wandb_id", "grad_scaler", "shards")
# format 2 added grad_scaler (dtype=float16's loss scale), format 3 shards. Earlier files still
# load: a format 1 run could not be fp16, and what a run without a scaler saves is {} (a disabled
# GradScaler's state_dict); before format 3 every checkpoint held whole tensors
_MISSING = {1: {"grad_scaler": {}, "shards": None}, 2: {"shards": None}}
_BOOKKEEPING = ("format_version", "sha256")
_TYPES = {"step": int, "model": dict, "optimizer": dict, "loader": dict, "rng": dict, "config": dict,
          "world_size": int, "data_parallel": int, "grad_scaler": dict, "shards": (dict, type(None))}


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or not finite; the message says which and what to do."""


def checkpoint_path(path: str | Path) -> Path:
    """A .pt file, or the run dir holding ckpt.pt."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def _digest(state: dict) -> str:
    h = hashlib.sha256()

    def visit(name: str, value) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{name}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{name}/{i}", item)
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{name}:{t.dtype}:{tuple(value.shape)}".encode())
            h.update(t.view(torch.uint8).numpy())
        else:
            h.update(f"{name}={value!r}".encode())

    visit("", {k: v for k, v in state.items() if k != "sha256"})
    return h.hexdigest()


def _as_tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def non_finite(state: dict) -> list[str]:
    """Names of the floating-point tensors in state (nested dicts) holding NaN or inf."""
    bad = []
    for key, value in state.items():
        if isinstance(value, dict):
            bad += [f"{key}.{name}" for name in non_finite(value)]
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(str(key))
    return bad


def save_checkpoint(path: Path, state: dict) -> None:
    """Writes state to path atomically, with its digest; refuses a state with NaN or inf weights."""
    bad = non_finite(state)
    if bad:
        raise CheckpointError(f"refusing to save a checkpoint with non-finite values in {', '.join(bad[:3])}"
                              f"{' ...' if len(bad) > 3 else ''}: the previous checkpoint at {path} is kept")
    if sorted(state) != sorted(KEYS):
        raise ValueError(f"a checkpoint holds {KEYS}, not {tuple(state)}")  # a programming error, not the user's
    state = {**state, "format_version": FORMAT_VERSION}
    state["sha256"] = _digest(state)
    atomic_write(path, lambda f: torch.save(state, f))


def require_checkpoint(path: Path) -> None:
    """CheckpointError, saying what to do, unless path is a file."""
    if path.is_file():
        return
    if path.exists():  # a directory (or a socket...) in a checkpoint's place: neither a run to continue nor none
        what = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"{path} is {what}, not a checkpoint file: remove it, or use another run dir")
    raise CheckpointError(f"no checkpoint at {path}: pass a run dir holding {CHECKPOINT_NAME} or a .pt file")


def load_checkpoint(path: Path, par=None) -> dict:
    """The state save_checkpoint wrote to path, after checking its digest, and a sharded one's
    shards against theirs (par: the job's trainer/parallel.py Parallel, whose processes share that;
    None: this process alone). A sharded state's "shards" gains "path", the shard directory."""
    require_checkpoint(path)
    damaged = f"checkpoint {path} is damaged"
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warnings: the one line below says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror}): check its permissions") from None
    except Exception as e:
        raise CheckpointError(f"{damaged} (it does not load: {type(e).__name__}); nothing can be loaded from it") from e
    if not isinstance(state, dict) or "sha256" not in state:
        raise CheckpointError(f"{path} holds no checksum: it is not a checkpoint written by train.py")
    if _digest(state) != state["sha256"]:
        raise CheckpointError(f"{damaged} (its contents do not match the checksum written with them); "
                              "nothing can be loaded from it")
    version = state.get("format_version", 1)
    if version not in (*_MISSING, FORMAT_VERSION):
        raise CheckpointError(f"checkpoint {path} is format {version}; this code reads formats 1 to {FORMAT_VERSION}: "
                              "use the version of flash-gpt that wrote it")
    state = {**_MISSING.get(version, {}), **state}
    missing = [k for k in KEYS if k not in state]
    extra = [str(k) for k in state if k not in KEYS and k not in _BOOKKEEPING]
    if missing or extra:
        what = "; ".join(f"{name} {', '.join(keys)}" for name, keys in (("lacks", missing), ("has unknown", extra))
                         if keys)
        raise CheckpointError(f"checkpoint {path} {what}: it was not written by this version of train.py")
    wrong = [f"{k} is a {type(state[k]).__name__}, not {' or '.join(c.__name__ for c in _as_tuple(t))}"
             for k, t in _TYPES.items() if not isinstance(state[k], t)]
    if wrong:
        raise CheckpointError(f"checkpoint {path}: {'; '.join(wrong)}: it was not written by train.py")
    bad = non_finite(state["model"])
    if bad:  # save_checkpoint never writes one: this file was made elsewhere
        raise CheckpointError(f"checkpoint {path} holds non-finite weights ({', '.join(bad[:3])}): resume from "
                              "another checkpoint")
    if state["shards"] is not None:
        shards = state["shards"] = {**state["shards"], "path": path.parent / state["shards"]["dir"]}
        try:
            verify_shards(shards["path"], shards["files"], par)
        except ShardError as e:
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {e}; nothing can be loaded from it") from None
    return state


def load_weights(model: torch.nn.Module, weights: dict, path: Path) -> None:
    """model.load_state_dict(weights), a mismatch said in one line (the model's code has changed)."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        raise CheckpointError(f"checkpoint {path} does not fit this model ({detail[:300]}): it was written by "
                              "another version of the model code") from None


def write_checkpoint(run) -> None:
    """Checkpoints a run (trainer/run.py's Run) to its run dir's ckpt.pt: rank 0 writes it; sharded,
    every process first writes its shards, and ckpt.pt names them. Every process must call it."""
    path = run.run_dir / CHECKPOINT_NAME
    shards = None
    if run.par.sharded:
        model, optimizer = run.par.state_dict(run.raw_model, run.optimizer)
        bad = non_finite_shards({"model": model, "optimizer": optimizer}, run.par)
        if bad:
            raise CheckpointError(f"refusing to save a checkpoint with non-finite values in {', '.join(bad[:3])}: "
                                  f"the previous checkpoint at {path} is kept")
        shards = save_shards(run.run_dir, run.step, {"model": model, "optimizer": optimizer}, run.par)
    if run.master:
        save_checkpoint(path, state_dict(run, shards))
        if shards is not None:
            remove_other_shards(run.run_dir, keep=shards["dir"])


def state_dict(run, shards: dict | None = None) -> dict:
    """Everything a checkpoint of a run (trainer/run.py's Run) holds; load_state_dict below restores
    exactly this. shards: where a sharded run's weights and optimizer state went (then not here)."""
    model, optimizer = run.par.state_dict(run.raw_model, run.optimizer) if shards is None else ({}, {})
    return {"step": run.step, "model": model, "optimizer": optimizer,
            "loader": run.train_loader.state_dict(), "best_val_loss": run.best_val,
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None},
            "config": plain(run.cfg), "world_size": run.par.world, "data_parallel": run.par.dp,
            "wandb_id": run.log.run.id if run.log else None, "grad_scaler": run.scaler.state_dict(),
            "shards": shards}


def load_state_dict(run, state: dict) -> None:
    run.step, run.best_val = state["step"], state["best_val_loss"]
    model, optimizer = state["model"], state["optimizer"]
    if state["shards"] is not None:  # read into this run's own shards, of whatever number of processes
        model, optimizer = run.par.state_dict(run.raw_model, run.optimizer)
        load_shards(state["shards"]["path"], {"model": model, "optimizer": optimizer})
    run.par.load_state_dict(run.raw_model, run.optimizer, model, optimizer,
                            lambda model, weights: load_weights(model, weights, run.cfg.resume))
    run.train_loader.load_state_dict(state["loader"])
    if state["grad_scaler"]:  # {} from a run without fp16 (dtype=auto on another GPU): a fresh scale
        run.scaler.load_state_dict(state["grad_scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if run.device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], run.device)
