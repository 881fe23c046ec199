"""Reads an offline W&B run's .wandb file with W&B's own protobuf schema (wandb.proto).

wandb >= 0.2x writes runs through its Go core and no longer ships a Python reader, so tests parse
the file format directly: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB-log
framing in 32 KiB blocks, each chunk a 4-byte CRC, 2-byte length, 1-byte type
(1 full, 2 first, 3 middle, 4 last), holding serialized wandb_internal_pb2.Record messages.
"""

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7  # chunk header: crc32c (4), length (2), type (1)


def records(path: Path, timeout: float = 60.0):
    """The records of a finished run's file. W&B's service may still be writing it when finish()
    returns (seen under load): wait for the exit record that ends it."""
    deadline = time.monotonic() + timeout
    while True:
        found = list(_parse(path))
        if any(rec.WhichOneof("record_type") == "exit" for rec in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _parse(path: Path):
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + HEADER <= len(raw):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER])
        chunk = raw[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: Path) -> list[dict]:
    """Every wandb.log() call of the run, as {key: value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def run_info(path: Path) -> dict:
    """The run record: id, group, name."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return {"id": rec.run.run_id, "group": rec.run.run_group, "name": rec.run.display_name}
    raise AssertionError(f"{path} holds no run record")


def ending(path: Path) -> dict:
    """How the run was closed: its exit code, and whether it was marked preempted first."""
    found = records(path)
    exits = [rec.exit.exit_code for rec in found if rec.WhichOneof("record_type") == "exit"]
    assert exits, f"{path} was not closed (no exit record)"
    return {"exit_code": exits[-1], "preempting": any(rec.WhichOneof("record_type") == "preempting" for rec in found)}
