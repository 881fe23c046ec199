"""Stopping on a scheduler's signal: SIGTERM, SIGUSR1 and SIGHUP, what Kubernetes, SLURM's --signal
and torchrun send before they stop a job. The step in flight finishes; train.py then checkpoints it
and exits 128 + the signal's number.

The handler never raises: it records the signal, and the run acts on it at a safe point. An
exception thrown from a handler lands wherever the main thread happens to be: inside
multiprocessing's pool shutdown, a lock's release or an at-fork callback (where Python drops it),
leaving a lock held or a worker waiting forever. During setup check() runs between stages and
between units of dataset preparation; in the loop signum() answers after each step. A forked child
(a tokenizing worker) gets the signals' default action instead of the parent's handler: it dies at
once, as a pool's shutdown expects of it.
"""

import ctypes
import os
import re
import signal
import threading

import torch
import torch.distributed as dist

from trainer.parallel import Parallel


class Stopped(BaseException):
    """A stop signal arrived while the run was being set up: no step ran, nothing is saved. A
    BaseException, as KeyboardInterrupt: a request to stop passes every `except Exception`."""

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
    """SIGTERM, SIGUSR1 and SIGHUP: what a scheduler sends before it preempts a job (Kubernetes,
    SLURM's --signal, torchrun passing SIGTERM on); during setup Ctrl-C (SIGINT) too. During setup
    check() raises Stopped once one arrived. In the loop the step in flight finishes, and signum()
    after it names the signal to stop for; Ctrl-C is Python's KeyboardInterrupt again. Under
    torchrun the ranks agree: each step all-reduces (MAX) the signal this rank got, and signum()
    answers with the previous step's result, read from pinned memory once that step's work is
    done, so every rank stops after the same step and the host still runs a step ahead."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

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
        """During setup: raises Stopped if a stop signal or Ctrl-C has arrived."""
        if self.received:
            raise Stopped(self.received)

    def start_loop(self) -> None:
        """Setup is over: Ctrl-C interrupts at once again (KeyboardInterrupt; train.py says where to resume)."""
        if signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

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


# every stop signal, scripts' and training's (Ctrl-C too): what nvrtc_first_compile holds back
STOP_SIGNALS = (*StopSignals.SIGNALS, signal.SIGINT)
