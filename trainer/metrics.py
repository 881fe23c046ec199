"""metrics.jsonl: one strict-JSON object per line, appended as a run goes, read back after any crash.

Non-finite numbers are written as null (bare NaN is not JSON). A line is appended whole or not at
all (data/files.py, append_line, which also drops a line a kill cut short before it appends);
readers drop a cut last line too, instead of failing on it.
"""

import json
import math
from pathlib import Path


def json_line(record: dict) -> str:
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


class MetricsError(ValueError):
    """A line of metrics.jsonl before its last is not JSON (the file was edited or damaged)."""

    def __init__(self, path: Path, line: int, text: str):
        super().__init__(f"{path}, line {line}, is not JSON: {text[:80]!r}")
        self.path, self.line = Path(path), line


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (none if it does not exist), without a cut-off last line;
    MetricsError for a damaged line before it."""
    if not Path(path).exists():
        return []
    records = []
    lines = Path(path).read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise MetricsError(path, i + 1, line) from None
    return records


def steady(train_records: list[dict]) -> list[dict]:
    """The training records that measure throughput: the first interval holds warmup, Triton
    autotuning and compilation, so it is left out (unless it is all there is)."""
    return train_records[1:] or train_records
