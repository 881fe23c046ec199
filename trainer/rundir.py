"""A run's directory: made, locked for the life of its process, continued, restarted or given up.

A run dir holds RUN_FILES once its run has written anything of its own; `.lock` (flock: released
by the kernel when the process ends, kill -9 too) keeps a second live run out. A default,
timestamped dir that another run took in the same second gets a suffix (claim_new). A fresh run
into a dir that holds a checkpoint or a finished run is refused; one into a dir whose run stopped
before its first checkpoint removes that run's records and starts again in place. A sweep job's
record of its command (.hydra/) is written here once its dir is held (write_record): Hydra would
write it before the job could know whether the dir is another run's.
"""

import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from configs.overrides import override
from configs.validate import ConfigError
from data.files import atomic_write, free_bytes
from trainer.checkpoint import CHECKPOINT_NAME, CheckpointError, checkpoint_path, require_checkpoint

RUN_FILES = ("metrics.jsonl", CHECKPOINT_NAME, "summary.json")  # what makes a dir a run's
# free bytes a run keeps on its dir's disk: room to close its records (summary.json, W&B's last
# blocks, which W&B drops without a word where they do not fit). A run starts only with this much
# free (before Hydra writes its record there) and stops, in one line, when less is left
RESERVE = 1 << 20
_locks: dict[Path, int] = {}  # run dirs this process holds, -> the open lock file
_created: set[Path] = set()  # run dirs this process made


def finished_summary(run_dir: Path) -> dict | None:
    """run_dir's summary.json if it says its run completed (status ok), else None."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return summary if summary.get("status") == "ok" else None
    except (OSError, ValueError, AttributeError):
        return None


def holds(run_dir: Path) -> bool:
    """Whether this process holds run_dir (claim_run_dir locked it)."""
    return Path(run_dir).resolve() in _locks


def write_record(run_dir: Path, task: DictConfig, hydra: DictConfig) -> None:
    """Hydra's record of the command in run_dir/.hydra (config.yaml, hydra.yaml, overrides.yaml, as
    Hydra writes them), each file whole: for a dir this process holds."""
    record = Path(run_dir) / ".hydra"
    record.mkdir(exist_ok=True)
    for name, node in (("config.yaml", task), ("hydra.yaml", hydra), ("overrides.yaml", hydra.hydra.overrides.task)):
        atomic_write(record / name, OmegaConf.to_yaml(node).encode())


def _check_room(run_dir: Path) -> None:
    if (free := free_bytes(run_dir)) < RESERVE:
        raise ConfigError(f"run dir {run_dir}: its disk has {free:,} bytes free, a run needs {RESERVE:,} for its "
                          "records: free some space or choose another hydra.run.dir")


def claim_run_dir(run_dir: Path, fresh: bool) -> None:
    """Creates run_dir if needed and locks it for this process (until it exits, kill -9 too).
    ConfigError if its disk has less than RESERVE free, if another live run holds it, or, for a
    fresh run, if an earlier run left a checkpoint or finished there (CheckpointError if its ckpt.pt
    is not a file). An earlier run that stopped before its first checkpoint left only records of
    steps no checkpoint holds: they are removed and the run starts again in place."""
    run_dir = Path(run_dir).resolve()
    if run_dir not in _locks:
        _check_room(run_dir)
        try:
            if not run_dir.exists():
                run_dir.mkdir(parents=True)
                _created.add(run_dir)
            fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a file in the way, no permission, a read-only disk
            raise ConfigError(f"run dir {run_dir} cannot be made or locked ({e.strerror}: {e.filename}): choose "
                              "another hydra.run.dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"run dir {run_dir} is in use by another running train.py: wait for it to finish, "
                              "or choose another hydra.run.dir") from None
        _locks[run_dir] = fd
        for stale in run_dir.iterdir():  # left by a kill -9 during a write; no one else writes here now
            if re.fullmatch(rf"\.({'|'.join(map(re.escape, RUN_FILES))})\..+\.tmp", stale.name):
                stale.unlink()
    if not fresh:
        return
    if (run_dir / CHECKPOINT_NAME).exists():
        require_checkpoint(run_dir / CHECKPOINT_NAME)
        raise ConfigError(f"run dir {run_dir} already holds a run: {override('resume', str(run_dir))} continues it; "
                          "choose another hydra.run.dir for a new one")
    if finished_summary(run_dir) is not None:
        raise ConfigError(f"run dir {run_dir} holds a finished run (without a checkpoint: ckpt_interval=-1): "
                          "choose another hydra.run.dir")
    leftovers = [name for name in RUN_FILES if (run_dir / name).exists()]
    if leftovers:
        for name in leftovers:
            (run_dir / name).unlink()
        print(f"run dir {run_dir}: its run stopped before its first checkpoint; starting it again from step 0 "
              f"in place", file=sys.stderr)


def resume_target(resume: str | Path) -> tuple[Path | None, Path]:
    """(the checkpoint resume= names, the run dir it continues in). (None, run dir) for a run dir
    without a checkpoint, whose run stopped before its first save: it starts again from step 0
    there. CheckpointError if `resume` names neither."""
    path = Path(resume).expanduser()
    ckpt = checkpoint_path(path)
    try:
        if ckpt.exists():
            require_checkpoint(ckpt)
            return ckpt, ckpt.parent
        is_run_dir = path.is_dir() and any((path / name).exists() for name in (*RUN_FILES, ".hydra", ".lock"))
    except OSError as e:
        raise CheckpointError(f"resume={resume}: {e.filename} cannot be read ({e.strerror})") from None
    if is_run_dir and finished_summary(path) is None:
        return None, path
    if is_run_dir:
        raise CheckpointError(f"resume={resume}: that run finished without writing a checkpoint "
                              f"(ckpt_interval=-1): there is nothing to continue")
    raise CheckpointError(f"resume={resume}: no checkpoint at {ckpt}: pass a run dir holding {CHECKPOINT_NAME} "
                          "or a .pt file")


def claim_new(template: Path) -> Path:
    """template itself if it is new, else template_2, _3, ...: created exclusively, so two runs
    started in the same second never share one."""
    _check_room(template)
    for n in range(1, 1000):
        path = template if n == 1 else template.with_name(f"{template.name}_{n}")
        try:
            path.mkdir(parents=True)
            _created.add(path.resolve())
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"{template}: 999 runs already started there in the same second")


def abandon_run_dir(run_dir: Path) -> None:
    """Removes a run dir this process made, when the run stopped before writing anything of its own
    (what is there is the lock and Hydra's record of the command: a dataset that cannot be had)."""
    run_dir = Path(run_dir).resolve()
    bookkeeping = {".lock", ".hydra", "train.log"}
    if run_dir in _created and all(p.name in bookkeeping for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
