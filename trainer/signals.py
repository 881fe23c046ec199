"""Stopping on a scheduler's signal: SIGTERM, SIGUSR1 and SIGHUP, what Kubernetes, SLURM's --signal
and torchrun send before they stop a job. The step in flight finishes; train.py then checkpoints it
and exits 128 + the signal's number."""

import signal
import threading

import torch
import torch.distributed as dist

from trainer.parallel import Parallel


class Stopped(Exception):
    """A stop signal arrived while the run was being set up: no step ran, nothing is saved."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step; nothing was saved: "
                         "the same command starts the run again")
        self.signum = signum


class StopSignals:
    """SIGTERM, SIGUSR1 and SIGHUP: what a scheduler sends before it preempts a job (Kubernetes,
    SLURM's --signal, torchrun passing SIGTERM on). During setup they stop the run at once
    (Stopped); in the loop the step in flight finishes, and signum() after it names the signal to
    stop for. Under torchrun the ranks agree: each step all-reduces (MAX) the signal this rank got,
    and signum() answers with the previous step's result, read from pinned memory once that step's
    work is done, so every rank stops after the same step and the host still runs a step ahead."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self):
        self.received = 0
        self.in_loop = False
        self._previous: dict = {}
        self._flag = self._host = self._done = None  # device flag, its host copy, the event after that copy

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signum
        if not self.in_loop:
            raise Stopped(signum)

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
