"""Sharded checkpoints: every process writes its own shards of the weights and AdamW state, in
parallel, and a load reshards them onto any number of processes (torch.distributed.checkpoint, DCP).

A sharded run (parallel.dp=fsdp) writes its shards to RUN_DIR/shards/step-<step>-<tag>/ (one file
per process and DCP's .metadata), each process hashing its share of the files. Then rank 0 writes
ckpt.pt (trainer/checkpoint.py) atomically: everything else a checkpoint holds, and the shard
directory's name with each file's sha256. ckpt.pt is the commit: a process killed, or a disk that
fills, while shards are written leaves the previous ckpt.pt and the shards it names; whatever ckpt.pt
does not name is removed by the next save. A load checks every file against its digest (the
processes share the reading) before DCP reads any of it.
"""

import errno
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from data.files import WriteError, sha256_file, write_error
from trainer.parallel import local

SHARDS_DIR = "shards"


class ShardError(ValueError):
    """Shards missing or not matching their digests; trainer/checkpoint.py raises it as its CheckpointError."""


def _digests(directory: Path, names: list[str], par) -> dict[str, str]:
    """{name: sha256} of every file named, this process hashing every world-th of them from its rank."""
    rank, world = (par.rank, par.world) if par is not None else (0, 1)
    mine = {name: sha256_file(directory / name) for name in sorted(names)[rank::world]}
    if par is None:
        return mine
    return {name: digest for part in par.gather(mine) for name, digest in part.items()}


class _Writer(FileSystemWriter):
    """DCP's writer of one file per process, whose failure to write is our one-line WriteError: DCP
    hands a process's failure to the others pickled, without the OSError that torch.save's
    RuntimeError was raised during."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            raise write_error(e, Path(self.path), "shards removed; the previous checkpoint is intact") or e


def _interruption(e: CheckpointException) -> BaseException | None:
    """A rank's Ctrl-C or stop that DCP wrapped: it goes on as itself."""
    return next((exc for exc, _ in e.failures.values() if not isinstance(exc, Exception)), None)


def save_shards(run_dir: Path, step: int, state: dict, par) -> dict:
    """Every process: writes its shards of state ({"model": ..., "optimizer": ...}, DTensors) under
    rank 0's run_dir/shards; returns, on every process, {"dir": the directory relative to run_dir, "files":
    {name: sha256}}. WriteError (on every process) if a file cannot be written; what was written
    of the directory is removed."""
    # a new directory for every save, in rank 0's run dir (the other ranks own none): one that every
    # node sees, as a resume there needs anyway
    name = f"step-{step:08d}-{secrets.token_hex(3)}"
    directory = Path(par.broadcast(str(Path(run_dir).resolve() / SHARDS_DIR / name)))
    try:
        # one writing thread: DCP's others would drop their failures unseen
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process alone is what is meant
            dcp.save(state, storage_writer=_Writer(directory), no_dist=par.world == 1)
    except CheckpointException as e:
        if (stop := _interruption(e)) is not None:
            raise stop from None
        failures = [exc for exc, _ in e.failures.values()]
        if par.master:
            shutil.rmtree(directory, ignore_errors=True)
        raise next((f for f in failures if isinstance(f, WriteError)), None) or \
            WriteError(errno.EIO, directory, f"{directory} cannot be written: {failures[0]}") from None
    names = sorted(os.listdir(directory))
    return {"dir": f"{SHARDS_DIR}/{directory.name}", "files": _digests(directory, names, par)}


def remove_other_shards(run_dir: Path, keep: str | None) -> None:
    """Rank 0, once ckpt.pt names `keep`: every other shard directory (earlier saves, one cut short)."""
    root = run_dir / SHARDS_DIR
    if root.is_dir():
        for directory in root.iterdir():
            if f"{SHARDS_DIR}/{directory.name}" != keep:
                shutil.rmtree(directory, ignore_errors=True)


def verify_shards(directory: Path, files: dict[str, str], par=None) -> None:
    """ShardError unless directory holds exactly `files`, each matching its sha256 (par: the job's
    trainer/parallel.py Parallel, whose processes share the hashing; None: this process hashes all)."""
    present = sorted(os.listdir(directory)) if directory.is_dir() else []
    missing, extra = sorted(set(files) - set(present)), sorted(set(present) - set(files))
    if missing or extra:
        said = "; ".join(f"{what} {', '.join(names[:3])}"
                         for what, names in (("lacks", missing), ("has unknown", extra)) if names)
        raise ShardError(f"its shard directory {directory} {said}" if directory.is_dir()
                         else f"its shard directory {directory} is missing")
    seen = _digests(directory, list(files), par)
    wrong = [name for name in sorted(files) if seen[name] != files[name]]
    if wrong:
        raise ShardError(f"its shard {directory / wrong[0]} does not match the checksum written with it")


def load_shards(directory: Path, state: dict) -> None:
    """Reads the shards in directory into state's tensors, in place (DTensors of any sharding, or
    whole tensors in a process of its own): DCP reshards what each process holds."""
    alone = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # alone is what is meant here
        dcp.load(state, checkpoint_id=directory, no_dist=alone)


def non_finite_shards(state: dict, par) -> list[str]:
    """Names of the floating-point tensors in state holding NaN or inf in this process's shards; on
    every process, ["a shard of another process"] where only another process found one."""
    bad = [name for name, t in _leaves(state) if t.is_floating_point() and not torch.isfinite(local(t)).all()]
    return bad if par.all_agree(not bad) or bad else ["a shard of another process"]


def _leaves(state, name: str = ""):
    """(name, tensor) of every tensor in nested dicts and lists."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _leaves(value, f"{name}.{key}" if name else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _leaves(value, f"{name}.{i}")
    elif isinstance(state, torch.Tensor):
        yield name, state
