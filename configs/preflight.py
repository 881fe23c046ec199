"""What train.py does before Hydra starts: a bad config gets one line, and every run a dir of its own.

Hydra creates the run dir, writes .hydra/ and opens train.log before the task starts, and reports a
bad override in a block of lines. preflight(argv) runs first: it composes the command line's config
itself, validates it (configs/validate.py), and only then picks the run dir and claims it (created
if new, locked for the life of the process), passing it to Hydra as an override (quoted: any path
the filesystem takes works). A bad config exits with code 2 and one line on stderr, having created
nothing. A resume runs in the original run's dir without a new Hydra record there. A default,
timestamped dir that another run took in the same second gets a suffix; an explicit hydra.run.dir
that holds another run is refused, unless that run stopped before its first checkpoint: it starts
again in place. Multirun (-m) jobs are validated one by one in train(); the sweep dir is claimed
here the same way.
"""

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.overrides import check_additions, override, quoted_where_needed
from configs.store import register_configs
from configs.validate import ConfigError, validate
from data.checkpoint import CHECKPOINT_NAME, CheckpointError, checkpoint_path

CONFIGS = Path(__file__).resolve().parent
RUN_FILES = ("metrics.jsonl", CHECKPOINT_NAME, "summary.json")  # what makes a dir a run's
_locks: dict[Path, int] = {}  # run dirs this process holds, -> the open lock file
_created: set[Path] = set()  # run dirs this process made


def _finished(run_dir: Path) -> bool:
    """Whether run_dir's summary.json says its run completed (status ok)."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def claim_run_dir(run_dir: Path, fresh: bool) -> None:
    """Creates run_dir if needed and locks it for this process (until it exits, kill -9 too).
    ConfigError if another live run holds it, or, for a fresh run, if an earlier run left a
    checkpoint or finished there. An earlier run that stopped before its first checkpoint left
    only records of steps no checkpoint holds: they are removed and the run starts again in place."""
    run_dir = Path(run_dir).resolve()
    if run_dir not in _locks:
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
        raise ConfigError(f"run dir {run_dir} already holds a run: {override('resume', str(run_dir))} continues it; "
                          "choose another hydra.run.dir for a new one")
    if _finished(run_dir):
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
        if ckpt.is_file():
            return ckpt, ckpt.parent
        is_run_dir = path.is_dir() and any((path / name).exists() for name in (*RUN_FILES, ".hydra", ".lock"))
    except OSError as e:
        raise CheckpointError(f"resume={resume}: {e.filename} cannot be read ({e.strerror})") from None
    if is_run_dir and not _finished(path):
        return None, path
    if is_run_dir:
        raise CheckpointError(f"resume={resume}: that run finished without writing a checkpoint "
                              f"(ckpt_interval=-1): there is nothing to continue")
    raise CheckpointError(f"resume={resume}: no checkpoint at {ckpt}: pass a run dir holding {CHECKPOINT_NAME} "
                          "or a .pt file")


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
        # Hydra's advice to append with +key= is refused here (configs/overrides.py): left out
        text = "; ".join(line for line in lines if not line.startswith(("See https://", "To append to your config")))
    if e.__cause__ is not None:
        text += ": " + str(e.__cause__).splitlines()[0]
    return text


def _compose(overrides: list[str]):
    register_configs()  # train.py's schema (idempotent): preflight runs before anything else did it
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _check_additions(overrides: list[str]) -> None:
    """+key=, ++key= and ~key against the config composed without them (configs/overrides.py)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports it
    others = [o.input_line for o in parsed if not (o.is_add() or o.is_force_add() or o.is_delete())]
    if len(others) == len(parsed):
        return
    try:
        composed = _compose([o for o in others if "," not in o])  # a sweep list composes one job at a time
    except (HydraException, OmegaConfBaseException):
        return  # Hydra reports it
    groups = {p.name for p in CONFIGS.iterdir() if p.is_dir() and not p.name.startswith("_")}
    try:
        check_additions(overrides, composed, groups)
    except ConfigError as e:
        _exit(str(e))


def _parse_args(argv: list[str]):
    """Hydra's own argument parser on argv, its error in one line (its flags go before the overrides)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return get_args_parser().parse_args(argv)
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]
        _exit(f"{message} (Hydra's flags -m, --cfg, ... go before the overrides: python train.py -m seq_len=256,512)")


def _check_sweep(overrides: list[str]) -> DictConfig:
    """The first job's config; every value of every sweep list composes (a typo or a value of the
    wrong type is one line here, not a block from Hydra after the sweep dir exists)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = {o.get_key_element(): list(o.sweep_string_iterator()) for o in parsed if o.is_sweep_override()}
    base = [o.input_line for o in parsed if not o.is_sweep_override()]
    first = [f"{key}={v[0]}" for key, v in values.items()]
    try:
        cfg = _compose(quoted_where_needed(base + first))
        for key, options in values.items():
            for value in options[1:]:
                _compose(quoted_where_needed(base + [f for f in first if not f.startswith(f"{key}=")] +
                                             [f"{key}={value}"]))
    except (HydraException, OmegaConfBaseException) as e:
        _exit(one_line(e))
    return cfg


def preflight(argv: list[str]) -> list[str]:
    """Checks train.py's command line before Hydra runs; returns the overrides to add to it (argv
    must be quoted_where_needed already)."""
    args = _parse_args(argv)
    _check_additions(args.overrides)
    if args.multirun:
        if any(re.match(r"\+*hydra\.sweep\.dir=", arg) for arg in args.overrides):
            return []
        cfg = _check_sweep(args.overrides)
        return [override("hydra.sweep.dir", str(_claim_new(Path(cfg.hydra.sweep.dir))))]
    if len(args.overrides) < len(argv):  # --cfg, --help, -cn ...: Hydra's own business
        return []
    try:
        cfg = _compose(argv)
    except (HydraException, OmegaConfBaseException) as e:
        _exit(one_line(e))
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    explicit = any(re.match(r"\+*hydra\.run\.dir=", arg) for arg in argv)
    try:
        validate(task, int(os.environ.get("WORLD_SIZE", "1")))
        if task.resume:
            ckpt, run_dir = resume_target(task.resume)
            run_dir = run_dir.resolve()
            if explicit and Path(cfg.hydra.run.dir).resolve() != run_dir:
                raise ConfigError(f"hydra.run.dir={cfg.hydra.run.dir} and resume={task.resume}: a resumed run goes "
                                  f"on in its own dir, {run_dir}: drop hydra.run.dir")
            claim_run_dir(run_dir, fresh=ckpt is None)
            if ckpt is not None:  # the original run's dir, held from here on; Hydra records nothing new there
                return [override("hydra.run.dir", str(run_dir)), "hydra.output_subdir=null"]
            return [override("hydra.run.dir", str(run_dir))]
        if explicit and not str(cfg.hydra.run.dir).strip():
            raise ConfigError("hydra.run.dir='': name a directory for the run (or leave it out for a new one "
                              "under outputs/)")
        run_dir = Path(cfg.hydra.run.dir) if explicit else _claim_new(Path(cfg.hydra.run.dir))
        claim_run_dir(run_dir, fresh=True)
    except (ConfigError, CheckpointError) as e:
        _exit(str(e))
    return [override("hydra.run.dir", str(run_dir))]
