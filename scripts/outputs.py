"""What the scripts write: tables (CSV, markdown), each replaced whole (data/files.py: a crash, a stop
or a full disk leaves the previous file, never half a new one; figures go through its save_figure).
A file that cannot be written raises WriteError, which ends the script in one line
(scripts/stopping.py's stoppable)."""

import csv
import io
from pathlib import Path

from data.files import atomic_write


def write_text(path: Path, text: str) -> None:
    atomic_write(path, text.encode())


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    """rows as CSV with a header of fields (a key a row lacks, or None, is an empty cell; others are left out)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore", restval="")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, text.getvalue())
