"""Crash-safe file writes and checksums, for datasets, checkpoints, metrics and caches alike.

atomic_write puts the bytes in a temp file beside the target (a unique name, so concurrent
writers never share one), fsyncs it, renames it over the target and fsyncs the directory: a
reader, a crash or a power loss sees the old file or the whole new one, never a mix. When the
disk fills up the temp file is removed and DiskFullError says so; the old file stays.
"""

import errno
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import: mkstemp's files are 0600, written files get the usual mode


class DiskFullError(OSError):
    """No space left for a write; the target was left as it was."""


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None] | bytes | Iterable[bytes]) -> None:
    """Replaces `path` with what `write(f)` writes (or with the given bytes, or chunks of bytes)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(write):
                write(f)
            else:
                for chunk in [write] if isinstance(write, bytes) else write:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if _is_disk_full(e):
            raise DiskFullError(errno.ENOSPC, f"disk full while writing {path} (temp file removed; "
                                              f"{'the previous file is intact' if path.exists() else 'nothing written'})"
                                ) from e
        raise
    fsync_dir(path.parent)


def _is_disk_full(e: BaseException) -> bool:
    # torch.save reports a failed write as RuntimeError("... unexpected pos ..."), with no errno
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
