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
here the same way, and Hydra's record of each job's command is left to train.py, which writes it
once the job's dir is its own. A sweep is continued by its own command into its sweep dir, not by
resume=.
"""

import contextlib
import io
import re
import sys
from pathlib import Path

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.overrides import (check_additions, compose_checked, override, quoted_where_needed, shell_override,
                               task_config)
from configs.schema import TrainConfig
from configs.store import register_configs
from configs.validate import ConfigError, launch_env, validate
from trainer.checkpoint import CheckpointError
from trainer.rundir import claim_new, claim_run_dir, resume_target

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose_checked(overrides: list[str]) -> DictConfig:
    """The config with Hydra's keys, every value resolved; ConfigError in one line."""
    register_configs()  # train.py's schema (idempotent): preflight runs before anything else did it
    return compose_checked(CONFIGS, "config", overrides, return_hydra_config=True)


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
        composed = _compose_checked([o for o in others if "," not in o])  # a sweep list composes one job at a time
    except ConfigError:
        return  # reported where the whole command is composed
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
    for o in parsed:
        if o.is_sweep_override() and o.get_key_element().lstrip("+").startswith("hydra."):
            key, _, value = o.input_line.partition("=")
            _exit(f"{o.input_line}: Hydra's own keys take one value, and in a sweep (-m) a comma separates values: "
                  f"quote the value to keep its comma: {shell_override(key, value)}")
    values = {o.get_key_element(): list(o.sweep_string_iterator()) for o in parsed if o.is_sweep_override()}
    base = [o.input_line for o in parsed if not o.is_sweep_override()]
    first = [f"{key}={v[0]}" for key, v in values.items()]
    try:
        cfg = _compose_checked(quoted_where_needed(base + first, TrainConfig))
        for key, options in values.items():
            for value in options[1:]:
                _compose_checked(quoted_where_needed(base + [f for f in first if not f.startswith(f"{key}=")] +
                                                     [f"{key}={value}"], TrainConfig))
    except ConfigError as e:
        _exit(str(e))
    return cfg


def _check_sweep_dir(sweep_dir: Path, overrides: list[str]) -> None:
    """A sweep continued into its own dir takes the overrides it was started with (max_steps may
    grow: its finished jobs train further): Hydra rewrites the dir's multirun.yaml, the record
    of the sweep's command, and must not write one of jobs that never ran."""
    try:
        recorded = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task
    except FileNotFoundError:
        return
    except (OSError, OmegaConfBaseException, AttributeError) as e:
        _exit(f"hydra.sweep.dir={sweep_dir}: its multirun.yaml cannot be read ({type(e).__name__}): choose another "
              "hydra.sweep.dir")

    def settings(items: list[str]) -> set[str]:
        return {o for o in items if not re.match(r"\+*max_steps=", o)}

    there, here = settings(recorded) - settings(overrides), settings(overrides) - settings(recorded)
    if there or here:
        _exit(f"hydra.sweep.dir={sweep_dir} holds a sweep of other overrides (it has {' '.join(sorted(there)) or '-'}"
              f"; this command {' '.join(sorted(here)) or '-'}): continue it with its own, or choose another "
              "hydra.sweep.dir")


# what a torchrun rank above 0 adds: rank 0 alone owns the Hydra run dir; the others get none and write nothing
FOLLOWER = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def placed(argv: list[str], added: list[str]) -> list[str]:
    """argv with the overrides `added` right after its own, which Hydra's parser takes as one run of
    arguments (`seq_len=64 -m` takes none after its flag)."""
    overrides = get_args_parser().parse_known_args(argv)[0].overrides
    n = len(overrides)
    at = next((i + n for i in range(len(argv) - n + 1) if argv[i:i + n] == overrides), len(argv)) if n else len(argv)
    return argv[:at] + added + argv[at:]


def preflight(argv: list[str]) -> list[str]:
    """Checks train.py's command line before Hydra runs; returns the overrides to add to it (argv
    must be quoted_where_needed already; placed() puts them where Hydra reads them): the run dir,
    or the sweep dir, claimed."""
    args = _parse_args(argv)
    _check_additions(args.overrides)
    if args.multirun:
        cfg = _check_sweep(args.overrides)
        if cfg.resume:
            _exit(f"resume={cfg.resume}: a sweep continues by its own command with hydra.sweep.dir=<its dir> (each "
                  "job resumes its own dir, finished jobs are skipped; a stopped sweep prints that command): drop "
                  "resume")
        # each job writes Hydra's record of its command itself, once its dir is its own (train.py)
        if any(re.match(r"\+*hydra\.sweep\.dir=", arg) for arg in args.overrides):
            _check_sweep_dir(Path(cfg.hydra.sweep.dir), [o for o in args.overrides if not re.match(r"\+*hydra\.", o)])
            return ["hydra.output_subdir=null"]
        return [override("hydra.sweep.dir", str(claim_new(Path(cfg.hydra.sweep.dir)))), "hydra.output_subdir=null"]
    if len(args.overrides) < len(argv):  # --cfg, --help, -cn ...: Hydra's own business
        return []
    try:
        cfg = _compose_checked(argv)
    except ConfigError as e:
        _exit(str(e))
    task = task_config(cfg)
    explicit = any(re.match(r"\+*hydra\.run\.dir=", arg) for arg in argv)
    try:
        validate(task, launch_env()["WORLD_SIZE"])
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
        run_dir = Path(cfg.hydra.run.dir) if explicit else claim_new(Path(cfg.hydra.run.dir))
        claim_run_dir(run_dir, fresh=True)
    except (ConfigError, CheckpointError) as e:
        _exit(str(e))
    return [override("hydra.run.dir", str(run_dir))]
