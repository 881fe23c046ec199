"""A program's first second: what train.py and every script do before their heavy imports.

startup(__name__), called before them, where the module runs as the program:
- A stop signal while the imports load (seconds: torch, Hydra, W&B) ends the program at once with
  `<program>: stopped by SIGINT while starting; nothing was done` and exit code 128 + the signal's
  number, where Python would print a KeyboardInterrupt traceback, or end in silence on a SIGTERM.
  Nothing has been made by then, so there is nothing to close. The program's own stop handling
  replaces these handlers before it makes anything (trainer/signals.py's StopSignals,
  scripts/stopping.py's stoppable); once it hands them back, a stop says the program ended.
- A HOME that cannot be written (read-only, missing): W&B, matplotlib, Triton and Hugging Face keep
  their caches and settings under it, and each says so in lines of its own (W&B's service in a line
  per event). They are pointed at a directory of this user's under the temp dir instead, and one
  line says so.
Standard library only: this loads before everything else.
"""

import os
import signal
import sys
import tempfile
from pathlib import Path

# what schedulers send before they stop a job (Kubernetes, SLURM's --signal, torchrun passing SIGTERM
# on), and Ctrl-C: every program stops on each of these, in one line
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)

# where each tool keeps its files, by default under HOME
_TOOL_DIRS = {"XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data",
              "MPLCONFIGDIR": "matplotlib", "TRITON_HOME": "triton", "WANDB_CONFIG_DIR": "wandb/config",
              "WANDB_CACHE_DIR": "wandb/cache", "WANDB_DATA_DIR": "wandb/data"}


_handed_over = False  # whether the program's own stop handling has taken over (it hands these back at its end)


def handed_over() -> None:
    """Called by the program's own stop handling as it takes over: a stop after it hands these
    handlers back, in the program's last moments (W&B's exit, Python's teardown), ends it saying so."""
    global _handed_over
    _handed_over = True


def startup(module_name: str) -> None:
    """Both of the above, where module_name is "__main__" (the program run, not imported)."""
    if module_name != "__main__":
        return
    program = Path(sys.argv[0]).name

    def stop(signum: int, frame) -> None:
        when = "as it ended; what it did is complete" if _handed_over else "while starting; nothing was done"
        print(f"{program}: stopped by {signal.Signals(signum).name} {when}", file=sys.stderr, flush=True)
        os._exit(128 + signum)  # no exception: an import in progress must not catch it

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    _tools_off_an_unwritable_home(program)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _tools_off_an_unwritable_home(program: str) -> None:
    home = Path(os.environ.get("HOME") or "~").expanduser()
    if _writable(home / ".cache") and _writable(home / ".config"):
        return
    instead = Path(tempfile.gettempdir()) / f"flash-gpt-home-{os.getuid()}"
    moved = [key for key in _TOOL_DIRS if not os.environ.get(key)]  # what the user set stays as set
    for key in moved:
        os.environ[key] = str(instead / _TOOL_DIRS[key])
    if moved and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 says it for all
        print(f"{program}: HOME ({home}) cannot be written: W&B, matplotlib, Triton and Hugging Face keep their "
              f"caches and settings in {instead} instead", file=sys.stderr, flush=True)
