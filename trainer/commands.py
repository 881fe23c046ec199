"""The shell commands a run prints (sample from it, train it further, resume it, continue its
sweep), written so that each runs as printed: each starts with the interpreter that ran this
process, shown relative to the working directory (.venv/bin/python from the repository), so the
packages it finds are the ones the run had.
"""

import re
import shlex
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from configs.overrides import override, shell_override

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"


def shown(path: Path | str) -> str:
    """path as a command line shows it: relative to the working directory where it lies under it
    (symlinks kept: a virtual environment's python is one)."""
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def command(*args: str) -> str:
    """A shell line that runs args with this process's interpreter."""
    return shlex.join([shown(sys.executable), *args])


def script_command(script: str, *args: str) -> str:
    """A shell line that runs the repository's script (its path under the repository, e.g.
    "scripts/sample.py") with args."""
    return command(shown(TRAIN_PY.parent / script), *args)


def sweeping() -> bool:
    """Whether this process runs a sweep's jobs (train.py -m)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def started_here() -> bool:
    """Whether this process is train.py's own command (not a script that runs train() in it)."""
    return Path(sys.argv[0]).resolve() == TRAIN_PY


def same_command(drop: str, *added: str) -> str:
    """This process's train.py command as a shell line, without the overrides whose key matches the
    regex `drop` (those preflight added among them), with the overrides `added` at the end."""
    args = [a for a in sys.argv[1:] if not re.match(rf"\+*({drop})=", a)]
    return command(sys.argv[0], *args, *added)


def sweep_command() -> str:
    """This sweep's command, into its sweep dir: what continues it (train.py -m, in a shell)."""
    return same_command(r"hydra\.(sweep\.dir|output_subdir)", override("hydra.sweep.dir", HydraConfig.get().sweep.dir))


def resume_hint(run_dir: Path) -> str:
    """What continues the run in run_dir, as the end of a line: the sweep's command; resume= added to
    train.py's own command; or, where a script ran it, train.py with resume=."""
    if sweeping():
        return f"{sweep_command()} continues the sweep (each job in its own dir; finished jobs are skipped)"
    if started_here():
        return f"add {shell_override('resume', str(run_dir))} to the same command to continue"
    return f"{script_command('train.py', override('resume', str(run_dir)))} continues it"


def continue_command(run_dir: Path, alone: bool, max_steps: int | None = None) -> str:
    """What continues the run in run_dir from its checkpoint (to max_steps, where given): train.py's
    own command with resume= where that command started this process alone, else what to add to it."""
    added = ([f"max_steps={max_steps}"] if max_steps else []) + [override("resume", shown(run_dir))]
    if alone and started_here():
        return same_command(r"hydra\.(run\.dir|output_subdir)|resume" + ("|max_steps" if max_steps else ""), *added)
    return f"add {shlex.join(added)} to the same command"


def sample_command(run_dir: Path, prompt: str) -> str:
    """The line that samples from the checkpoint in run_dir."""
    return script_command("scripts/sample.py", override("ckpt", shown(run_dir)), override("prompt", prompt))
