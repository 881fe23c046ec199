"""How a script stops: a stop signal ends it at once, in one line, with the signal's exit code.

SIGTERM, SIGHUP and SIGUSR1 (what schedulers send before they stop a job) and SIGINT (Ctrl-C)
raise Stop wherever the script is inside `stoppable` (around its main, once its imports are done:
a signal during those ends it as Python does); stoppable ends the script with one line on stderr,
`<script>: stopped by SIGTERM; <what is kept>`, and exit code 128 + the signal's number (130 for
Ctrl-C), then and there (_exit_now): no traceback, no verdict, table or plot of work cut short, and
no work queued in a thread pool (torch.compile's kernels) run first. Stop is no Exception, so
a script's `except Exception` around one cell or rung does not swallow it; one that Python loses
(raised where C code drops errors) is raised again each second until it lands. A script writes its
files whole or not at all (scripts/outputs.py), so a stop leaves the previous file, never half of
one, and a file that cannot be written (disk full, read-only) ends it inside stoppable in one
line too, with exit code 1. Inside train.train() the scheduler's signals
finish the step in flight and checkpoint it (trainer/signals.py): trained() runs it and then
stops the script there the same way.
"""

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn

from data.files import WriteError
from trainer.signals import STOP_SIGNALS, nvrtc_first_compile
from trainer.startup import handed_over

if TYPE_CHECKING:
    from omegaconf import DictConfig


class Stop(BaseException):
    """A stop signal arrived: the script ends (stoppable says so)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Python can lose an exception a signal handler raises: one raised while a __hash__ or __eq__ runs
# for C code that clears its errors (a dict lookup) vanishes without a word, and the script runs
# on. So a stop is raised again every RETRY_S until stoppable has it.
RETRY_S = 1.0


class _Pending:
    signum = 0  # the stop signal that arrived, 0 before one did


def _stopper(pid: int, pending: _Pending) -> Callable:
    """The handler that raises Stop in process `pid`, and raises it again (SIGALRM, _again) until
    stoppable has it. A process forked from it (a pool's worker) inherits the handler: there the
    signal ends it as it would without one, never raising into the worker's queue handling (which
    would hang the pool's terminate())."""
    def stop(signum: int, frame) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not pending.signum:
            pending.signum = signum
            signal.setitimer(signal.ITIMER_REAL, RETRY_S, RETRY_S)
        raise Stop(signum)
    return stop


def _again(pending: _Pending) -> Callable:
    """SIGALRM's handler while a stop is pending: Stop again, unless an exception is on its way out
    (the stop itself, or what it broke: stoppable sees the pending signal either way)."""
    def again(signum: int, frame) -> None:
        if sys.exc_info()[1] is None:
            raise Stop(pending.signum)
    return again


def _set(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _exit_now(code: int) -> NoReturn:
    """Ends a stopped script now. Python's own exit would first join every thread pool's threads,
    which run the work still queued: stopped inside torch.compile, every compile job queued
    (minutes on a CPU). What the script holds has been closed as the stop unwound it (files are
    written whole or not at all); what exit hooks would close is closed here, each step on its own
    (one that fails says so in a line): the run dirs it holds, W&B (an open run finished, and its
    service waited for, so that its offline files end whole), the standard streams."""
    steps = []
    if (rundir := sys.modules.get("trainer.rundir")) is not None:
        steps.append(("the run dirs' locks", rundir.release_run_dirs))
    if (wandb := sys.modules.get("wandb")) is not None:
        steps.append(("W&B", lambda: wandb.teardown(exit_code=code)))
    for what, step in steps:
        try:
            step()
        except Exception as e:  # the stop ends the process whatever fails here
            print(f"error: closing {what} as the script stopped: {e}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a full disk, a closed pipe: nothing more can be said
            pass
    os._exit(code)


@contextlib.contextmanager
def stoppable(script: str, kept: Callable[[], str]) -> Iterator[None]:
    """Inside, a stop signal ends the script: one line naming the signal and kept() (what the
    stop leaves: the files written so far, or that there is no result), exit 128 + signum; a file
    that cannot be written ends it with one line too, exit 1."""
    pending = _Pending()
    previous = {sig: signal.signal(sig, _stopper(os.getpid(), pending)) for sig in STOP_SIGNALS}
    handed_over()
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _again(pending))
    try:
        nvrtc_first_compile()  # NVRTC's own stop handler, now and not at cuDNN's first call
        yield
    except BaseException as e:  # a stop (raised here or by the handler), or what a stop broke
        signal.setitimer(signal.ITIMER_REAL, 0)
        signum = e.signum if isinstance(e, Stop) else pending.signum
        if signum:
            _set(dict.fromkeys(STOP_SIGNALS, signal.SIG_DFL))  # a second signal ends the process at once
            print(f"{script}: stopped by {signal.Signals(signum).name}; {kept()}", file=sys.stderr)
            _exit_now(128 + signum)
        if isinstance(e, WriteError):
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _set(previous)


def trained(cfg: "DictConfig", run_dir: Path) -> dict:
    """train.train(cfg, run_dir)'s summary; Stop where a signal stopped the run (in its setup, after
    its step in flight, checkpointed, or as it closed): the script stops with it."""
    import train  # the trainer: loaded by the scripts that train, not by every one that stops
    from trainer.rundir import abandon_run_dir
    from trainer.signals import Stopped

    try:
        summary = train.train(cfg, run_dir)
    except Stopped as e:  # in its setup: nothing of it was saved
        abandon_run_dir(run_dir)
        raise Stop(e.signum) from None
    except Exception:  # where it could not start, the dir it made goes, as under train.py's own command
        abandon_run_dir(run_dir)
        raise
    if "signal" in summary:  # stopped in its loop, or as it closed (its status is then ok): the script stops too
        raise Stop(signal.Signals[summary["signal"]])
    return summary
