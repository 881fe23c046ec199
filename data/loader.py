"""Training batches from a prepared dataset: random windows of tokens, reproducible across resumes.

A prepared dataset is a directory holding `train.bin` and `val.bin` (flat uint16 GPT-2 tokens, an
EOT after each document) and `meta.json`, written last by data/prepare.py as the completion marker.
load_meta() is the one place that decides whether such a directory is complete and intact.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "val")


class DatasetError(ValueError):
    """A prepared dataset is missing, incomplete or corrupt, or too small for the request."""


def load_meta(dataset_dir: str | Path) -> dict:
    """meta.json of a complete dataset, after checking that each bin has the size it records."""
    d = Path(dataset_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        problem = "has no meta.json (never prepared, or prepare was interrupted)" if d.is_dir() else "not found"
        raise DatasetError(f"dataset {d} {problem}: prepare it with scripts/prepare_data.py {d.name}, or let "
                           "train.py prepare it")
    corrupt = f"corrupt or truncated: delete {d} and re-run prepare"
    try:
        meta = json.loads(meta_path.read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        expected = {split: meta["splits"][split]["tokens"] * itemsize for split in SPLITS}
        meta["config"], [meta["splits"][split]["sha256"] for split in SPLITS]  # what prepare checks them by
    except OSError as e:
        raise DatasetError(f"{meta_path} cannot be read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{meta_path} is unreadable ({e!r}): {corrupt}") from e
    for split, size in expected.items():
        path = d / f"{split}.bin"
        actual = path.stat().st_size if path.is_file() else "missing"
        if actual != size:
            raise DatasetError(f"{path} is {actual} bytes, meta.json says {size}: {corrupt}")
    return meta


class TokenWindows:
    """Batches of (x, y) token windows from one split; y is x shifted left by one token.

    Windows start at uniformly random offsets and may span document boundaries, as in nanoGPT.
    The offsets come from a CPU torch.Generator; save state_dict() in a checkpoint and a resumed
    run draws exactly the batches the interrupted one would have drawn next.

    Under data parallelism every rank draws the same global batch of batch_size * world_size
    offsets and keeps its own slice: the ranks see different windows, and the global batch is
    the one a single process with batch_size * world_size would draw, whatever the world size.
    """

    def __init__(
        self,
        dataset_dir: str | Path,
        split: str,
        seq_len: int,
        batch_size: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        cycle: bool = False,
    ):
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}: expected one of {SPLITS}")
        meta = load_meta(dataset_dir)
        self.n_tokens = meta["splits"][split]["tokens"]
        # a window that wraps around the split: only if asked for, and only if it must
        self.wraps = cycle and self.n_tokens < seq_len + 1
        if self.n_tokens < seq_len + 1 and not self.wraps:
            raise DatasetError(
                f"{split} split of {dataset_dir} has {self.n_tokens} tokens, need at least "
                f"seq_len+1 = {seq_len + 1}: use a smaller seq_len, a bigger dataset or data.cycle=true"
            )
        self.path = Path(dataset_dir) / f"{split}.bin"
        self.dtype = np.dtype(meta["dtype"])
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.rank, self.world_size = rank, world_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 of shape (batch_size, seq_len), on self.device."""
        T = self.seq_len
        B = self.batch_size
        n = self.n_tokens if self.wraps else self.n_tokens - T
        starts = torch.randint(n, (B * self.world_size,), generator=self.generator)
        starts = starts[self.rank * B:(self.rank + 1) * B]  # this rank's slice of the global batch
        windows = self._read(starts.numpy(), T + 1)  # (B, T+1)
        x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))  # (B, T)
        y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))  # (B, T)
        if self.device.type == "cuda":
            # from pinned memory the host-to-device copy runs asynchronously, overlapping compute
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def _read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows of `length` tokens at `starts`, int64 (len(starts), length). Read, not memory-
        mapped: a file cut short under a mapping kills the reader (SIGBUS), where a read comes back
        short, and a DatasetError says so."""
        item = self.dtype.itemsize
        changed = f"{self.path} changed while it was read: {{}} bytes, {self.n_tokens * item:,} when it was opened " \
                  "(cut short, or prepared again)"
        try:
            with open(self.path, "rb") as f:  # each batch: a file replaced meanwhile is seen as it now is
                size = os.fstat(f.fileno()).st_size
                if size != self.n_tokens * item:
                    raise DatasetError(changed.format(f"{size:,}"))
                if self.wraps:  # the whole split is shorter than one window
                    data = np.frombuffer(f.read(), dtype=self.dtype)
                    return data[(starts[:, None] + np.arange(length)) % self.n_tokens].astype(np.int64)
                rows = [os.pread(f.fileno(), length * item, int(start) * item) for start in starts]
                if any(len(row) != length * item for row in rows):  # cut short since the fstat
                    raise DatasetError(changed.format(f"{os.fstat(f.fileno()).st_size:,}"))
        except OSError as e:  # deleted, or its disk gone
            raise DatasetError(f"{self.path} cannot be read any more ({e.strerror})") from None
        return np.frombuffer(b"".join(rows), dtype=self.dtype).reshape(len(starts), length).astype(np.int64)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
