"""The scripts' command lines: a bad one is refused in one line, `error: ...`, exit code 2, having created nothing.

argparse prints its usage above the error; ArgumentParser here prints the error alone, and the
types below name the value and what is allowed. Every check runs on the arguments alone, before a
script asks for a GPU (so each is testable on any machine) and before it creates a file. The Hydra
scripts compose their config here before @hydra.main runs (Hydra reports a bad override in a block
of lines), as trainer/preflight.py does for train.py; train_config() checks the train.py overrides
that a benchmark passes on, before its first run.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, NoReturn

import torch
from hydra._internal.utils import get_args_parser  # the parser @hydra.main runs: its flags, no copy of them
from omegaconf import DictConfig

from configs.overrides import compose_checked
from configs.store import register_configs
from configs.validate import ConfigError, validate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def fail(message: str) -> NoReturn:
    """How every refused command line ends."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, with every error in one line; an unknown argument is answered with the known ones."""

    def __init__(self, *args, **kwargs):
        self.known: list[str] = []  # before super().__init__, which adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        action = super().add_argument(*names, **kwargs)
        self.known += action.option_strings or [action.dest]
        return action

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}; {self.prog} takes {', '.join(self.known)} "
                       "(--help says what each does)")
        return parsed

    def error(self, message: str) -> NoReturn:
        fail(message)


# -----------------------------------------------------------------------------
# types: each raises ArgumentTypeError naming the value, which argparse prefixes with the argument


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _comma_list(text: str, parse: Callable[[str], object], what: str) -> list:
    """text's comma-separated items through `parse`; each must be `what`, and listed once."""
    items = []
    for item in text.split(","):
        try:
            value = parse(item)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not {what} (give a comma list, each value "
                                             "once)") from None
        if value in items:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is listed twice (give a comma list, each value once)")
        items.append(value)
    return items


def positive_ints(text: str) -> list[int]:
    """'1024,8192' -> [1024, 8192]."""
    return _comma_list(text, positive_int, "a positive integer")


def non_negative_ints(text: str) -> list[int]:
    """'0,65536' -> [0, 65536]."""
    return _comma_list(text, non_negative_int, "an integer >= 0")


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """The type of a comma list of names from `choices`: 'a,b' -> ['a', 'b']."""
    choices = list(choices)

    def one(item: str) -> str:
        if item not in choices:
            raise ValueError(item)
        return item
    return lambda text: _comma_list(text, one, f"one of {', '.join(choices)}")


def require_divisors(parser: argparse.ArgumentParser, flag: str, values: list[int], total: int, total_flag: str,
                     what: str) -> None:
    """One parser error naming flag's values that do not divide total (total_flag's value, `what`)."""
    if bad := [x for x in values if total % x]:
        parser.error(f"argument {flag}: {bad} do not divide {total_flag} {total} ({what}): choose divisors of it")


def unwritable(path: Path) -> str | None:
    """Why this process cannot write into directory `path` (made if missing), or None: a file in the way, or
    a nearest existing directory that it may not write to."""
    for existing in (path, *path.parents):  # a relative path's last parent, '.', exists
        if existing.exists():
            break
    if not existing.is_dir():
        return "is a file, not a directory" if existing == path else f"{existing} is a file: no directory goes under it"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def directory(text: str) -> Path:
    """A directory to write into, made when the work starts (give a string default: argparse types those)."""
    problem = unwritable(Path(text))
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}: choose a directory this user can create or write into")
    return Path(text)


def require_cuda(script: str, gpus: int = 1) -> None:
    """One line and exit 2 unless this machine has `gpus` CUDA GPUs; called once the arguments are checked."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < gpus:
        need = "a CUDA GPU" if gpus == 1 else f"{gpus} CUDA GPUs"
        fail(f"{script} needs {need}; this machine has {have} (torch.cuda.device_count()): run it on one that has")


# -----------------------------------------------------------------------------
# Hydra command lines


def _compose(config_name: str, overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config these overrides compose to, every value resolvable; or one line and exit 2."""
    try:
        return compose_checked(CONFIGS, config_name, overrides, return_hydra_config)
    except ConfigError as e:
        fail(str(e))


def hydra_config(argv: list[str], config_name: str) -> DictConfig | None:
    """The config a Hydra script's command line composes to (its schema registered already), Hydra's
    own keys with it (hydra.run.dir: task_config() leaves them out); one line and exit 2 for an
    unknown flag, overrides that do not compose, or a run dir that cannot be made. None where a flag
    (--help, --cfg, -m ...) makes the command line Hydra's own business."""
    parser = get_args_parser()
    parser.exit_on_error = False  # raise, not print the usage
    try:
        _, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        fail(str(e))
    if unknown:
        fail(f"unrecognized arguments: {' '.join(unknown)}: pass key=value overrides of configs/{config_name}.yaml, "
             "or one of Hydra's flags (--help lists both)")
    if any(arg.startswith("-") for arg in argv):
        return None
    cfg = _compose(config_name, argv, return_hydra_config=True)
    problem = unwritable(Path(cfg.hydra.run.dir))
    if problem:
        fail(f"hydra.run.dir={cfg.hydra.run.dir}: {problem}: choose a directory this user can create or write into")
    return cfg


def train_config(overrides: list[str], world: int = 1) -> DictConfig:
    """train.py's config for these overrides, checked as train.py checks it in `world` processes (under
    torchrun where world > 1); one line and exit 2 where it does not compose or cannot run."""
    register_configs()
    cfg = _compose("config", overrides)
    # as rank 0 of torchrun's `world` processes sees it (parallel.dp=fsdp runs there alone)
    launched = {} if world == 1 or "RANK" in os.environ else {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
    os.environ.update(launched)
    try:
        validate(cfg, world)
    except ConfigError as e:
        fail(str(e))
    finally:
        for key in launched:
            del os.environ[key]
    return cfg
