"""What train.py does before Hydra starts: a bad config gets one line, and every run a dir of its own.

Hydra creates the run dir, writes .hydra/ and opens train.log before the task starts, and reports a
bad override in a block of lines. preflight(argv) runs first: it composes the command line's config
itself, validates it (configs/validate.py), and only then picks the run dir and claims it (created
if new, locked for the life of the process), passing it to Hydra as an override. A bad config exits
with code 2 and one line on stderr, having created nothing. A resume runs in the original run's dir
without a new Hydra record there. A default, timestamped dir that another run took in the same
second gets a suffix; an explicit hydra.run.dir that holds another run is refused.
Multirun (-m) jobs are validated one by one in train(); the sweep dir is claimed here the same way.
"""

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.validate import ConfigError, validate
from data.checkpoint import CHECKPOINT_NAME, CheckpointError, checkpoint_path, require_checkpoint

CONFIGS = Path(__file__).resolve().parent
RUN_FILES = ("metrics.jsonl", CHECKPOINT_NAME, "summary.json")  # what makes a dir a run's
_locks: dict[Path, int] = {}  # run dirs this process holds, -> the open lock file
_created: set[Path] = set()  # run dirs this process made


def claim_run_dir(run_dir: Path, fresh: bool) -> None:
    """Creates run_dir if needed and locks it for this process (until it exits, kill -9 too).
    ConfigError if another live run holds it, or, for a fresh run, if an earlier run left its files."""
    run_dir = Path(run_dir).resolve()
    if run_dir not in _locks:
        if not run_dir.exists():
            run_dir.mkdir(parents=True)
            _created.add(run_dir)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
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
    if fresh and any((run_dir / name).exists() for name in RUN_FILES):
        raise ConfigError(f"run dir {run_dir} already holds a run: resume={run_dir} continues it; "
                          "choose another hydra.run.dir for a new one")


def _claim_new(template: Path) -> Path:
    """template itself if it is new, else template_2, _3, ...: created exclusively, so two runs
    started in the same second never share one."""
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


def one_line(e: Exception) -> str:
    """A Hydra/OmegaConf composition error as one line: what was wrong and what is allowed."""
    lines = [line.strip() for line in str(e).split("Config search path:")[0].splitlines() if line.strip()]
    options = [line for line in lines[1:] if not line.endswith(":") and not line.endswith("_schema")]
    if lines and "Available options" in str(e):
        text = f"{lines[0]}; choose one of: {', '.join(options)}"
    else:
        text = "; ".join(line for line in lines if not line.startswith("See https://"))
    if e.__cause__ is not None:
        text += ": " + str(e.__cause__).splitlines()[0]
    return text


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def preflight(argv: list[str]) -> list[str]:
    """Checks train.py's command line before Hydra runs; returns the overrides to add to it."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    if any(arg in ("-m", "--multirun") for arg in argv):
        if any(re.match(r"\+*hydra\.sweep\.dir=", arg) for arg in argv):
            return []
        try:  # the sweep lists (a,b,c) do not compose; the sweep dir does not depend on them
            cfg = _compose([arg for arg in overrides if "," not in arg])
        except (HydraException, OmegaConfBaseException):
            return []  # Hydra reports it
        return [f"hydra.sweep.dir={_claim_new(Path(cfg.hydra.sweep.dir))}"]
    if len(overrides) < len(argv):  # --cfg, --help, -cn ...: Hydra's own business
        return []
    try:
        cfg = _compose(argv)
    except (HydraException, OmegaConfBaseException) as e:
        _exit(one_line(e))
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    try:
        validate(task, int(os.environ.get("WORLD_SIZE", "1")))
        if task.resume:  # the original run's dir, held from here on; Hydra records nothing new there
            ckpt = checkpoint_path(task.resume).resolve()
            try:
                require_checkpoint(ckpt)
            except CheckpointError as e:
                raise CheckpointError(f"resume={task.resume}: {e}") from None
            claim_run_dir(ckpt.parent, fresh=False)
            return [f"hydra.run.dir={ckpt.parent}", "hydra.output_subdir=null"]
        explicit = any(re.match(r"\+*hydra\.run\.dir=", arg) for arg in argv)
        run_dir = Path(cfg.hydra.run.dir) if explicit else _claim_new(Path(cfg.hydra.run.dir))
        claim_run_dir(run_dir, fresh=True)
    except (ConfigError, CheckpointError) as e:
        _exit(str(e))
    return [f"hydra.run.dir={run_dir}"]
