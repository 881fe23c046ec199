"""Checkpoint files: written atomically with a checksum of everything they hold, verified on load.

A checkpoint is one torch.save'd dict (load it with torch.load(path, weights_only=True)) with a
"sha256" entry: the digest of every other entry, tensors by their bytes, other values by their
repr, in key order. A crash or kill -9 mid-save leaves the previous file (data/files.py); a
block zeroed or flipped afterwards (what a power loss or a bad disk leaves) fails the digest or
the unpickling, and load_checkpoint refuses the file in one line instead of resuming from it.
"""

import hashlib
from pathlib import Path

import torch

from data.files import atomic_write

CHECKPOINT_NAME = "ckpt.pt"


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
    state = {**state, "sha256": _digest(state)}
    atomic_write(path, lambda f: torch.save(state, f))


def require_checkpoint(path: Path) -> None:
    """CheckpointError, saying what to pass instead, unless path is a file."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: pass a run dir holding {CHECKPOINT_NAME} or a .pt file")


def load_checkpoint(path: Path) -> dict:
    """The state save_checkpoint wrote to path, after checking its digest."""
    require_checkpoint(path)
    damaged = f"checkpoint {path} is damaged"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{damaged} (it does not load: {type(e).__name__}); nothing can resume from it") from e
    if not isinstance(state, dict) or "sha256" not in state:
        raise CheckpointError(f"{path} holds no checksum: it is not a checkpoint written by train.py")
    if _digest(state) != state["sha256"]:
        raise CheckpointError(f"{damaged} (its contents do not match the checksum written with them); "
                              "nothing can resume from it")
    return state
