"""What the scripts write, and how a write that fails ends them: tables (CSV, markdown) and figures,
each replaced whole (data/files.py: a crash or a full disk leaves the previous file, never half a
new one); a file that cannot be written ends the script with one line and exit code 1 (run_script)."""

import csv
import io
import sys
from collections.abc import Callable
from pathlib import Path

from data.files import WriteError, atomic_path, atomic_write


def run_script(main: Callable[[], None]) -> None:
    """A script's entry point: main(), and one line for a file it could not write (disk full, read-only)."""
    try:
        main()
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, text.encode())


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    """rows as CSV with a header of fields (a key a row lacks, or None, is an empty cell; others are left out)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore", restval="")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, text.getvalue())


def save_figure(fig, path: Path) -> None:
    """fig.savefig(path) at 120 dpi, in the format path's suffix names."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix[1:], dpi=120)
