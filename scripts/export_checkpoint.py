"""Makes one checkpoint file of a sharded run's checkpoint (parallel.dp=fsdp): for a learner's
torch.load, for another tool, or to keep.

    python scripts/export_checkpoint.py outputs/<date>/<run> [--out whole.pt]

Reads RUN's ckpt.pt and the shards it names, each checked against its digest, in this one process
(DCP's format_utils joins the shards: the whole weights and AdamW state pass through this host's
memory), and writes --out (default RUN/ckpt-whole.pt): the same checkpoint with whole tensors, as
an unsharded run writes it, with its own checksum. It loads with
torch.load(path, weights_only=True); scripts/sample.py ckpt=<it> samples from it; copied as ckpt.pt
into a new run dir, resume=<that dir> continues the run under parallel.dp=fsdp on any number of
processes.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from scripts.args import ArgumentParser, fail, unwritable  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402
from trainer.checkpoint import KEYS, CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint  # noqa: E402


def export(path: Path, out: Path) -> int:
    """Writes the whole checkpoint of `path` (a sharded run's ckpt.pt) to out; its step."""
    state = load_checkpoint(path)
    if state["shards"] is None:
        raise CheckpointError(f"{path} already holds its weights and optimizer state: it is one file")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        joined = Path(tmp) / "joined.pt"
        dcp_to_torch_save(state["shards"]["path"], joined)
        whole = torch.load(joined, map_location="cpu", weights_only=True)
    save_checkpoint(out, {**{key: state[key] for key in KEYS}, **whole, "shards": None})
    return state["step"]


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, metavar="RUN", help="a sharded run's directory, or its ckpt.pt")
    parser.add_argument("--out", type=Path, help="the file to write (default: RUN/ckpt-whole.pt)")
    args = parser.parse_args()
    path = checkpoint_path(args.run)
    out = args.out or path.parent / "ckpt-whole.pt"
    if problem := unwritable(out.parent):
        fail(f"--out {out}: " + (f"{out.parent} {problem}" if problem.startswith("is a") else problem))
    try:
        step = export(path, out)
    except CheckpointError as e:
        fail(str(e))
    print(f"wrote {out}: the checkpoint of step {step}, whole (torch.load(path, weights_only=True))")


if __name__ == "__main__":
    with stoppable("export_checkpoint.py", lambda: "the file is whole: the one written before, or none"):
        main()
