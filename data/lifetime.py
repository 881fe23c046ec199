"""What a process holds ends with it: its file locks, and the processes it started.

- FileLock: flock on a file, which the kernel releases when its holder ends, kill -9 included.
  The file names its holder ("process N on HOST"), so that a process kept waiting can say for
  whom, and one that takes the lock over from a holder that ended without releasing it says so.
  A lock is held by an open file description, which a forked child shares: so the children of a
  holder (tokenizing workers) die with it.
- die_with_parent(): a child process asks the kernel for a signal once its parent ends (Linux's
  parent-death signal): SIGKILL for a pool worker, which would otherwise live on after a kill -9
  of its parent, re-parented to PID 1, its parent's locks held, waiting forever on its task
  queue; SIGTERM for a training run a script started, which then checkpoints and stops.
"""

import ctypes
import fcntl
import os
import re
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """In a child of process `parent`: have the kernel send it `signum` once the parent ends (Linux;
    it holds across exec), and end it now if the parent has already gone (it ended between the fork
    and this call)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _processes_with_open(path: Path) -> list[int]:
    """The processes of this machine (that this user may inspect) with `path` open."""
    target = str(Path(path).resolve())
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


class FileLock:
    """An exclusive flock on `path` (created if missing; it stays), naming its holder inside."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self) -> bool:
        """Takes the lock if it is free; False if another process holds it. OSError if the file
        cannot be made or opened."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def holder(self) -> str:
        """Who the file says holds the lock ("process N on HOST"), or "" where no one does."""
        try:
            return self.path.read_text(errors="replace").strip()
        except OSError:
            return ""

    def take(self) -> str | None:
        """Once acquired: names this process as the holder; returns the holder before it where that one
        ended without releasing the lock (killed, or its machine went down), else None."""
        before = self.holder()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        return before or None

    def release(self) -> None:
        """Clears the record and releases the lock (a holder that ends without this leaves its name)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None

    def blocked_by(self) -> str:
        """Who holds the lock, as a line that waits or refuses says it: the recorded holder; where that
        process is gone from this machine, the processes that still hold the file open."""
        said = self.holder() or "another process"
        match = re.fullmatch(r"process (\d+) on (\S+)", said)
        if match and match[2] == socket.gethostname() and not _alive(int(match[1])):
            others = [pid for pid in _processes_with_open(self.path) if pid != os.getpid()]
            if others:
                return f"processes {', '.join(map(str, others))}, left by {said} (which is gone): end them to go on"
        return said
