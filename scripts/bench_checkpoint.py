"""Save and load time, and peak host memory, of a sharded run's checkpoint: the shards train.py
writes (trainer/shards.py) beside one file gathered to rank 0, in the same run.

    torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py model=gpt2_small
    torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py \
        model.n_layer=24 model.d_model=2048 model.n_head=16

The arguments are train.py overrides; parallel.dp=fsdp is added. The run is set up as train.py
sets it up (setup: the model sharded over the processes, AdamW), AdamW takes one step of zero
gradients (its state exists, as in any checkpoint after step 1), and then, each in turn:
- shards:   train.py's save (every process writes its shards and hashes them; rank 0 writes
            ckpt.pt), and its load (every file checked against its digest, DCP reads each
            process's part);
- one file: the weights and AdamW state gathered whole to rank 0 on the CPU, written there by
            torch.save with its checksum, and read by every process, which keeps its shards.
Time is wall time between barriers; peak host memory is the largest rise of a process's resident
set over the operation (Linux's VmHWM, reset before it); size is what the files take on disk. The
checkpoints go to a temp dir under --dir (default: the working directory), removed at the end.
"""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     get_optimizer_state_dict)

from scripts.args import fail, train_config  # noqa: E402
from trainer.checkpoint import (CHECKPOINT_NAME, load_checkpoint, load_state_dict, save_checkpoint,  # noqa: E402
                                state_dict, write_checkpoint)
from trainer.run import Run, setup  # noqa: E402


def resident_gib(field: str) -> float:
    """This process's VmRSS or VmHWM (its peak since the last reset), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(run: Run, fn) -> tuple[float, float]:
    """(seconds, the largest rise of any process's resident set, GiB) of fn() on every process."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = resident_gib("VmRSS")
    sync = torch.cuda.synchronize if run.device.type == "cuda" else lambda: None
    sync()
    run.par.barrier()
    start = time.perf_counter()
    fn()
    sync()
    run.par.barrier()
    seconds = time.perf_counter() - start
    return seconds, max(run.par.gather(resident_gib("VmHWM") - before))


def gathered_save(run: Run) -> None:
    """One file, the weights and AdamW state gathered whole to rank 0 (on the CPU) and written there."""
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(run.raw_model, options=whole)
    optimizer = get_optimizer_state_dict(run.raw_model, run.optimizer, options=whole)
    if run.master:  # state_dict(run, shards=...) holds every key but the tensors, which go in here
        state = {**state_dict(run, shards={}), "model": model, "optimizer": optimizer, "shards": None}
        save_checkpoint(run.run_dir / "whole" / CHECKPOINT_NAME, state)


def size_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def main() -> None:
    overrides = [a for a in sys.argv[1:] if not a.startswith("--dir=")]
    where = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--dir=")), ".")
    if "RANK" not in os.environ:
        fail("bench_checkpoint.py runs under torchrun: torchrun --standalone --nproc_per_node=N "
             "scripts/bench_checkpoint.py [train.py overrides]")
    cfg = train_config(overrides + ["parallel.dp=fsdp", "wandb.mode=disabled", "sample_tokens=0", "eval_steps=0"],
                       int(os.environ["WORLD_SIZE"]))
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint.", dir=where)) if int(os.environ["RANK"]) == 0 else None
    run = setup(cfg, root / "run" if root else Path("."))
    for p in run.raw_model.parameters():
        p.grad = torch.zeros_like(p)
    run.optimizer.step()  # AdamW's state, as in every checkpoint
    run.optimizer.zero_grad(set_to_none=True)
    rows = []
    seconds, peak = measured(run, lambda: write_checkpoint(run))
    rows.append(("shards", "save", seconds, peak))
    run_dir = Path(run.par.broadcast(str(run.run_dir)))  # rank 0's: the others own no run dir
    path = run_dir / CHECKPOINT_NAME
    seconds, peak = measured(run, lambda: load_state_dict(run, load_checkpoint(path, run.par)))
    rows.append(("shards", "load", seconds, peak))
    if run.master:
        (run.run_dir / "whole").mkdir()
    seconds, peak = measured(run, lambda: gathered_save(run))
    rows.append(("one file on rank 0", "save", seconds, peak))
    whole = run_dir / "whole" / CHECKPOINT_NAME
    seconds, peak = measured(run, lambda: load_state_dict(run, load_checkpoint(whole)))
    rows.append(("one file on rank 0", "load", seconds, peak))
    if run.master:
        params = sum(p.numel() for p in run.raw_model.parameters())
        sizes = {"shards": size_gib(run.run_dir / "shards") + path.stat().st_size / 2**30,
                 "one file on rank 0": size_gib(run.run_dir / "whole")}
        device = torch.cuda.get_device_name() if run.device.type == "cuda" else "CPU"
        print(f"\n{params / 1e6:,.0f} M parameters, {run.par.world} processes, torch {torch.__version__}, {device}\n")
        print("| checkpoint | op | seconds | peak host GiB (max over processes) | on disk GiB |")
        print("|---|---|--:|--:|--:|")
        for name, op, seconds, peak in rows:
            print(f"| {name} | {op} | {seconds:.2f} | {peak:.2f} | {sizes[name]:.2f} |")
        shutil.rmtree(root, ignore_errors=True)
    run.par.close()


if __name__ == "__main__":
    main()
