"""A run's directory: made, locked for the life of its process, continued, restarted or given up.

A run dir holds RUN_FILES once its run has written anything of its own; `.lock` (flock: released
by the kernel when the process ends, kill -9 too; data/lifetime.py) keeps a second live run out,
and a run that takes it from one that was killed says so. A file of the run that is a link to
nothing (its disk not mounted) stops whoever comes, in one line, before anything is touched. A default,
timestamped dir that another run took in the same second gets a suffix (claim_new). A fresh run
into a dir that holds a checkpoint or a finished run is refused; one into a dir whose run stopped
before its first checkpoint removes that run's records and starts again in place. A sweep job's
record of its command (.hydra/) is written here once its dir is held (write_record): Hydra would
write it before the job could know whether the dir is another run's.
"""

import atexit
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from configs.overrides import override
from configs.schema import plain
from configs.validate import ConfigError, check_resume
from data.files import atomic_write, free_bytes
from data.lifetime import FileLock
from trainer.checkpoint import CHECKPOINT_NAME, CheckpointError, checkpoint_path, load_checkpoint, require_checkpoint
from trainer.metrics import MetricsError, read_metrics

RUN_FILES = ("metrics.jsonl", CHECKPOINT_NAME, "summary.json")  # what makes a dir a run's
# free bytes a run keeps on its dir's disk: room to close its records (summary.json, W&B's last
# blocks, which W&B drops without a word where they do not fit). A run starts only with this much
# free (before Hydra writes its record there) and stops, in one line, when less is left
RESERVE = 1 << 20
_locks: dict[Path, FileLock] = {}  # run dirs this process holds
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
        lock = FileLock(run_dir / ".lock")
        try:
            if not run_dir.exists():
                run_dir.mkdir(parents=True)
                _created.add(run_dir)
            elif not any(run_dir.iterdir()):  # empty (Hydra made a sweep job's): nothing of anyone's to keep
                _created.add(run_dir)
            got = lock.acquire()
        except OSError as e:  # a file in the way, no permission, a read-only disk
            raise ConfigError(f"run dir {run_dir} cannot be made or locked ({e.strerror}: {e.filename}): choose "
                              "another hydra.run.dir") from None
        if not got:
            raise ConfigError(f"run dir {run_dir} is in use by another running train.py ({lock.blocked_by()}): wait "
                              "for it to finish, or choose another hydra.run.dir")
        if gone := lock.take():
            print(f"run dir {run_dir}: {gone} ended without closing it (killed?); this run takes it over",
                  file=sys.stderr)
        _locks[run_dir] = lock
        for stale in run_dir.iterdir():  # left by a kill -9 during a write; no one else writes here now
            if re.fullmatch(rf"\.({'|'.join(map(re.escape, RUN_FILES))})\..+\.tmp", stale.name):
                stale.unlink()
        _refuse_odd_files(run_dir, ConfigError)
    if not fresh:
        return
    if (record := run_dir / ".hydra").exists() and not record.is_dir():  # where Hydra records the new run
        raise ConfigError(f"{record} is a file, not Hydra's record of a run: remove it, or use another run dir")
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
    """(the checkpoint resume= names, the run dir it continues in): a run dir, or its ckpt.pt. (None,
    run dir) for a run dir without a checkpoint, whose run stopped before its first save: it starts
    again from step 0 there. CheckpointError if `resume` names neither, or another .pt file."""
    path = Path(resume).expanduser()
    ckpt = checkpoint_path(path)
    try:
        _refuse_odd_files(ckpt.parent, CheckpointError, f"resume={resume}: ")
        if ckpt.exists():
            require_checkpoint(ckpt)
            if ckpt.name != CHECKPOINT_NAME:  # the run would go on in its dir, over that dir's own run
                raise CheckpointError(
                    f"resume={resume}: a run goes on in its own dir, from the {CHECKPOINT_NAME} there, and writes over "
                    f"that dir's {CHECKPOINT_NAME}, metrics and summary; to go on from {ckpt.name}, copy it as "
                    f"{CHECKPOINT_NAME} into a new dir and pass resume=<that dir>")
            read_metrics(ckpt.parent / "metrics.jsonl")  # appended to from here: a damaged line is refused first
            return ckpt, ckpt.parent
        is_run_dir = path.is_dir() and any((path / name).exists() for name in (*RUN_FILES, ".hydra", ".lock"))
    except OSError as e:
        raise CheckpointError(f"resume={resume}: {e.filename} cannot be read ({e.strerror})") from None
    except MetricsError as e:
        raise CheckpointError(f"resume={resume}: {e}; nothing was touched: delete that line "
                              f"(sed -i '{e.line}d' {shlex.quote(str(e.path))}) and resume again") from None
    if is_run_dir and finished_summary(path) is None:
        return None, path
    if is_run_dir:
        raise CheckpointError(f"resume={resume}: that run finished without writing a checkpoint "
                              f"(ckpt_interval=-1): there is nothing to continue")
    raise CheckpointError(f"resume={resume}: no checkpoint at {ckpt}: pass a run dir holding {CHECKPOINT_NAME}")


def _refuse_odd_files(run_dir: Path, error: type, prefix: str = "") -> None:
    """error, in one line, where a file of the run in run_dir is not one: a link to nothing (its disk
    not mounted), a directory in its place. Nothing is touched, let alone replaced, until it is
    mended (ckpt.pt's own check, require_checkpoint, says the same of it)."""
    for name in RUN_FILES:
        path = Path(run_dir) / name
        if path.is_symlink() and not path.exists():
            raise error(f"{prefix}{path} is a link to {os.readlink(path)}, which does not exist (a disk not "
                        "mounted?): nothing was touched; mount it or mend the link, then run again")
        if name != CHECKPOINT_NAME and path.exists() and not path.is_file():
            raise error(f"{prefix}{path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a file: "
                        "remove it, or use another run dir")


def release_run_dirs() -> None:
    """Give up every run dir this process holds: a process that ends cleanly leaves no holder's name
    in their locks (train.py calls it before it hands its stop handling back: a stop after that ends
    the process with os._exit, which skips atexit)."""
    for lock in _locks.values():
        lock.release()


atexit.register(release_run_dirs)


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
    if run_dir in _created and run_dir.is_dir() and all(p.name in bookkeeping for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def resume_point(cfg: DictConfig, par, run_dir: Path) -> tuple[dict | None, Path]:
    """(the checkpoint to continue from, the run dir), or (None, run_dir) for a fresh run (par: the
    job's trainer/parallel.py Parallel). Metrics, W&B and checkpoints continue in the original run's
    dir; a run that stopped before its first checkpoint starts again there (claim_run_dir says so)."""
    if not cfg.resume:
        return None, run_dir
    path, run_dir = resume_target(hydra.utils.to_absolute_path(cfg.resume))
    if path is None:
        return None, run_dir
    ckpt = load_checkpoint(path, par)
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
