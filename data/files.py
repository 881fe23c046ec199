"""Crash-safe file writes and checksums, for datasets, checkpoints, metrics, caches and results alike.

The files of datasets, runs and the scripts' results go through three calls (Hydra's record and
W&B's files are theirs to write), and each either completes or fails with a WriteError whose str()
is one line (which file, why, and what became of it):
- atomic_write puts the bytes in a temp file beside the target (a unique name, so concurrent
  writers never share one), fsyncs it, renames it over the target and fsyncs the directory: a
  reader, a crash or a power loss sees the old file or the whole new one, never a mix;
- atomic_path does the same for a writer that takes a path (a profiler's export, save_figure);
- append_line adds one line to a JSON-lines file whole, or leaves the file as it was.
A full disk or a quota is a DiskFullError, any other failure of the filesystem (read-only, no
permission, a directory in the file's place, a file size limit) a WriteError; the temp file is
removed and the old file stays.
"""

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO


class WriteError(OSError):
    """A file could not be written: no space, a quota, a read-only filesystem, no permission, a
    directory in its place... str() is the one line to show; errno, strerror and filename are the
    failure's own."""

    def __init__(self, code: int, filename: Path, said: str):
        super().__init__(code, os.strerror(code), str(filename))
        self.said = said

    def __str__(self) -> str:
        return self.said

    def __reduce__(self):  # whole through pickle (a sharded save hands one process's failure to the others)
        return type(self), (self.errno, self.filename, self.said)


class DiskFullError(WriteError):
    """No space left for a write (or over a quota); the target was left as it was."""


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """e and what it was raised from or during, in turn: torch.save reports a failed write as a
    RuntimeError ("unexpected pos") raised while handling what failed (the OSError of the disk, the
    KeyboardInterrupt of a Ctrl-C), which is the error to go by."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def write_error(e: BaseException, path: Path, kept: str) -> WriteError | None:
    """The one-line error for a write of `path` that failed with e (or with an error it was raised
    from), `kept` saying what became of the file; None for a failure that is not the filesystem's.
    By type and errno alone: a full disk or a quota is a DiskFullError, any other OSError (read-only,
    no permission, a directory in the file's place, over a file size limit, an I/O error) a
    WriteError that names its strerror."""
    for cause in _chain(e):
        if isinstance(cause, WriteError):
            return cause
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFullError(errno.ENOSPC, path, f"disk full while writing {path} ({kept})")
        if isinstance(cause, OSError) and cause.errno is not None:
            return WriteError(cause.errno, path, f"{path} cannot be written: {cause.strerror} ({kept})")
    return None


def _interruption(e: BaseException) -> BaseException | None:
    """The stop (Ctrl-C's KeyboardInterrupt, a script's Stop: what is no Exception) that e is or was
    raised during, or None."""
    return next((cause for cause in _chain(e) if not isinstance(cause, Exception)), None)


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path beside `path` to write to; once the block completes it is fsynced and renamed
    over `path`. If the block fails, the temp file is removed and `path` is as it was."""
    path = Path(path)
    # Named here and created inside the try, not by mkstemp: a Ctrl-C that lands the moment the file
    # appears still removes it. 64 random bits: no other writer picks the same name.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        made = False
        # a name taken already is another writer's file, never ours to remove; and the cleanup never
        # hides e (a directory that cannot be searched, a file where the directory should be)
        if not (isinstance(e, FileExistsError) and e.filename == str(tmp)):
            with contextlib.suppress(OSError):
                made = tmp.exists()
                tmp.unlink(missing_ok=True)
        if (stop := _interruption(e)) is not None and stop is not e:
            raise stop  # a Ctrl-C inside torch.save comes out as its RuntimeError: the stop goes on as itself
        kept = ("temp file removed; " if made else "") + (
            "the previous file is intact" if path.exists() else "nothing written")
        if (error := write_error(e, path, kept)) is not None:
            raise error from e
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path, write: Callable[[BinaryIO], None] | bytes | Iterable[bytes]) -> None:
    """Replaces `path` with what `write(f)` writes (or with the given bytes, or chunks of bytes)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        if callable(write):
            write(f)
        else:
            for chunk in [write] if isinstance(write, bytes) else write:
                f.write(chunk)


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as path (120 dpi, in the format path's suffix names), replaced whole."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix[1:], dpi=120)


def _whole_lines_end(fd: int) -> int:
    """The size of the file up to its last newline: what stays of a file whose last line was cut."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - 4096)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def append_line(path: Path, line: str) -> None:
    """Appends `line` (ending in a newline) to `path` whole, or leaves the file as it was and raises
    WriteError. A line cut short by a crash (kill -9 mid-append) is dropped first: no record is
    ever glued to a torn one."""
    data = memoryview(line.encode())
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_error(e, path, "nothing written") or e from None
    try:
        end = _whole_lines_end(fd)
        os.ftruncate(fd, end)
        try:
            while data:  # a write may take part of the line: the rest follows, or the file is cut back
                data = data[os.write(fd, data):]
        except BaseException as e:
            os.ftruncate(fd, end)
            if (error := write_error(e, path, "the file is as it was")) is not None:
                raise error from e
            raise
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    """Bytes free to this process on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    st = os.statvfs(next(p for p in (path, *path.parents) if p.exists()))
    return st.f_bavail * st.f_frsize


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
