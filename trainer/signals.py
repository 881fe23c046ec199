"""Stopping on a scheduler's signal (SIGTERM, SIGUSR1, SIGHUP) or Ctrl-C, at every phase of a run.

What a stop signal does, phase by phase (train.py's process has these handlers from before it
claims a run dir to its exit, through every job of a sweep; trainer/startup.py covers its imports):
- until the first step (the command line's checks, Hydra's start, setup): it is recorded, and
  check() raises Stopped at the next boundary between stages or units of dataset preparation:
  nothing was saved, and the run dir is given up;
- the loop: a scheduler's signal lets the step in flight finish, and train.py checkpoints it;
  Ctrl-C interrupts at once (KeyboardInterrupt), and train.py closes the run at the last checkpoint;
- the end (end_loop(): after the last step, or once a stop has ended the loop): every stop signal,
  Ctrl-C too, is recorded, so the stop's checkpoint, summary.json, curves.png and W&B's close are
  each written whole; the end-of-run sample calls check() between tokens and is given up.

The handler never raises: it records the signal, and the run acts on it at a safe point. An
exception thrown from a handler lands wherever the main thread happens to be: inside
multiprocessing's pool shutdown, a lock's release or an at-fork callback (where Python drops it),
leaving a lock held or a worker waiting forever. A forked child (a tokenizing worker) gets the
signals' default action instead of the parent's handler: it dies at once, as a pool's shutdown
expects of it.
"""

import contextlib
import ctypes
import os
import re
import signal
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainer.parallel import Parallel
from trainer.startup import STOP_SIGNALS, handed_over


class Stopped(BaseException):
    """A stop signal acted on outside the loop: while the run was being set up (no step ran, nothing
    is saved: its message says so), or between the end-of-run sample's tokens, where train.py
    catches it and closes the run. A BaseException, as KeyboardInterrupt: a request to stop passes
    every `except Exception`."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step; nothing was saved: "
                         "the same command starts the run again")
        self.signum = signum


_active: "StopSignals | None" = None  # the instance whose handler is installed in this process


def _defaults_in_child() -> None:
    if _active is not None:
        for sig in _active._previous:
            signal.signal(sig, signal.SIG_DFL)


os.register_at_fork(after_in_child=_defaults_in_child)


def _loaded_nvrtc() -> str | None:
    """The path of the NVRTC library this process has loaded (torch's CUDA wheels load it as torch is
    imported, for cuDNN), or None."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:  # not Linux
        return None
    found = re.search(r"(/\S*/libnvrtc\.so\.[\d.]+)$", maps, re.MULTILINE)  # libnvrtc.so.13, or .so.13.0.88
    return found[1] if found else None


def nvrtc_first_compile() -> None:
    """Makes the process's first NVRTC compile now, the stop signals held back in this thread while
    it runs. cuDNN compiles its attention graphs at run time with NVRTC, and the NVRTC of torch's
    CUDA 13.0 wheels puts its own SIGTERM and SIGINT handler in place during its first compile in a
    process (for 14-26 ms): a stop signal then ends the process from inside the library, exit
    code 4 and no line, or hangs it, before any handler of ours runs (docs/failures.md). It does so
    once a process, so done here, as a script or run starts, the first cuDNN call (seconds or
    minutes later) has no such window. What remains is this compile's, at the start, and only for
    a signal that another thread of the process takes (this one's waits until the compile is done).
    Nothing is done where NVRTC is not loaded (CPU builds), cannot be called, or after the first call."""
    global _nvrtc_compiled
    path = None if _nvrtc_compiled else _loaded_nvrtc()
    if path is None:
        return
    _nvrtc_compiled = True
    try:
        nvrtc = ctypes.CDLL(path)  # the loaded library itself, not a second copy
        create, compile_, destroy = nvrtc.nvrtcCreateProgram, nvrtc.nvrtcCompileProgram, nvrtc.nvrtcDestroyProgram
    except (OSError, AttributeError):
        return
    program = ctypes.c_void_p()
    if create(ctypes.byref(program), b'extern "C" __global__ void nothing() {}', b"nothing.cu", 0, None, None) != 0:
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        compile_(program, 0, None)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        destroy(ctypes.byref(program))


_nvrtc_compiled = False


class StopSignals:
    """Records SIGTERM, SIGUSR1, SIGHUP and Ctrl-C (SIGINT) as they arrive; the phases above say
    when each is acted on. Under torchrun the ranks agree in the loop: each step all-reduces (MAX)
    the signal this rank got, and signum() answers with the previous step's result, read from
    pinned memory once that step's work is done, so every rank stops after the same step and the
    host still runs a step ahead."""

    def __init__(self):
        self.received = 0
        self._pid = os.getpid()
        self._previous: dict = {}
        self._flag = self._host = self._done = None  # device flag, its host copy, the event after that copy

    def __enter__(self) -> "StopSignals":
        global _active
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
            _active = self
            handed_over()
            nvrtc_first_compile()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if _active is self:
            _active = None

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a child forked before its at-fork reset ran: die as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = self.received or signum

    def check(self) -> None:
        """Raises Stopped if a stop signal has arrived (called in setup, and between the sample's tokens)."""
        if self.received:
            raise Stopped(self.received)

    def start_loop(self) -> None:
        """Setup is over: Ctrl-C interrupts at once again (KeyboardInterrupt)."""
        self._flag = self._host = self._done = None  # a sweep's next job agrees on its own device
        if self._previous:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def end_loop(self) -> None:
        """The loop is over, or a stop ends it: Ctrl-C is recorded too from here, and the run closes whole."""
        if self._previous:
            signal.signal(signal.SIGINT, self._handle)

    def signum(self, parallel: Parallel) -> int:
        """After a step: the signal to stop for (the same on every rank), or 0 to go on."""
        if parallel.world == 1:
            return self.received
        agreed = self.settle()
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=parallel.device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=parallel.device.type == "cuda")
        self._flag.fill_(self.received)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True).wait()  # CUDA: the stream waits, not the host
        self._host.copy_(self._flag, non_blocking=True)
        if parallel.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()
        return agreed

    def settle(self) -> int:
        """The last all-reduced signal (0 if none yet), once it is on the host; after this no
        all-reduce of ours is in flight."""
        if self._host is None:
            return 0
        if self._done is not None:
            self._done.synchronize()
        return int(self._host.item())


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """The StopSignals in place in this process (train.py's, which every job of a sweep shares), or
    a new one for the block (train() called by a test or a script)."""
    if _active is not None and _active._pid == os.getpid():
        yield _active
    else:
        with StopSignals() as stop:
            yield stop
