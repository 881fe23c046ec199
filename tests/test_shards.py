"""Sharded checkpoints (parallel.dp=fsdp, trainer/shards.py) under torchrun on the CPU (gloo).

- written by 2 processes, resumed by 4 from the shards and by 1 from the file that
  scripts/export_checkpoint.py makes of them: the losses equal those of one process trained
  through (to 1e-5: the gradients' sums run over other process counts), and sample.py reads the
  shards and the exported file alike;
- a kill -9 while the shards are written leaves the previous checkpoint whole, and the next save
  removes what was cut short;
- a shard that is damaged, missing or joined by a stranger, or a shard directory that is gone, is
  refused in one line, before anything is loaded.
    .venv/bin/python -m pytest tests/test_shards.py -q
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train as train_module
from tests.helpers import ENV, REPO, TINY, compose, last_step, metrics, torchrun
from trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from trainer.parallel import Parallel
from trainer.shards import load_shards, save_shards

RUN = TINY + ["model.n_layer=2", "batch_tokens=128", "log_interval=1", "eval_interval=2", "wandb.mode=disabled",
              "ckpt_interval=3", "parallel.dp=fsdp", "sample_tokens=0", "max_steps=6"]


def train(n: int, args: list[str], cwd: Path) -> None:
    """train.py ARGS under torchrun, n processes, one BLAS thread each."""
    torchrun(n, [str(REPO / "train.py"), *args], cwd, timeout=600, env=ENV)


def script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=ENV)


def losses(run_dir: Path, after: int) -> list[tuple]:
    """(step, "loss" or "val_loss", value) of each record after step `after`."""
    return [(r["step"], key, r[key]) for r in metrics(run_dir) if r["step"] > after for key in ("loss", "val_loss")
            if key in r]


@pytest.mark.slow
def test_written_on_two_processes_resumed_on_four_and_from_its_export_on_one(data_root, tmp_path):
    common = RUN + [f"data.root={data_root}"]
    train(2, [*common, "max_steps=3", f"hydra.run.dir={tmp_path / 'cut'}"], tmp_path)
    shards = load_checkpoint(tmp_path / "cut" / "ckpt.pt")["shards"]
    assert shards["dir"].startswith("shards/step-00000003-") and len(list((tmp_path / "cut" / "shards").iterdir())) == 1
    assert sorted(shards["files"]) == [".metadata", *sorted(p.name for p in shards["path"].glob("*.distcp"))]
    assert not list(tmp_path.glob("shards"))  # no rank wrote into its working directory
    for n in (4, 1):
        shutil.copytree(tmp_path / "cut", tmp_path / f"on{n}", ignore=shutil.ignore_patterns("ckpt-whole.pt"))
    exported = script("export_checkpoint.py", str(tmp_path / "cut"), cwd=tmp_path)
    assert exported.returncode == 0 and "ckpt-whole.pt" in exported.stdout, exported.stderr
    whole = torch.load(tmp_path / "cut" / "ckpt-whole.pt", weights_only=True)
    assert whole["shards"] is None and whole["step"] == 3 and {"state", "param_groups"} <= set(whole["optimizer"])
    shutil.rmtree(tmp_path / "on1" / "shards")  # the run dir of the one file, as its export's note says
    shutil.copy(tmp_path / "cut" / "ckpt-whole.pt", tmp_path / "on1" / "ckpt.pt")
    train(4, [*common, f"resume={tmp_path / 'on4'}"], tmp_path)
    train(1, [*common, f"resume={tmp_path / 'on1'}"], tmp_path)
    plain = [a for a in common if not a.startswith("parallel.")] + ["ckpt_interval=-1"]
    train_module.train(compose(plain), tmp_path / "through")  # one process, in this one
    through = losses(tmp_path / "through", 3)
    for n in (4, 1):
        resumed = losses(tmp_path / f"on{n}", 3)
        assert [r[:2] for r in resumed] == [r[:2] for r in through], n
        for a, b in zip(resumed, through):
            assert a[2] == pytest.approx(b[2], rel=1e-5, abs=0), (n, a, b)
    samples = [script("sample.py", f"ckpt={ckpt}", "max_new_tokens=8", "device=cpu", "attention=sdpa", cwd=tmp_path)
               for ckpt in (tmp_path / "cut", tmp_path / "cut" / "ckpt-whole.pt")]
    assert [s.returncode for s in samples] == [0, 0], samples[0].stderr[-2000:] + samples[1].stderr[-2000:]
    assert samples[0].stdout == samples[1].stdout


@pytest.mark.slow
def test_a_kill_9_while_shards_are_written_leaves_the_last_checkpoint_whole(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, f"data.root={data_root}", "ckpt_interval=1", "eval_interval=0", "max_steps=400",
            f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "train.py"), *args]
    with open(tmp_path / "run.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=ENV)
    shards = run_dir / "shards"
    try:  # a second shard directory: one save's shards are being written, the last one's still named
        while proc.poll() is None and not (shards.is_dir() and len(os.listdir(shards)) > 1
                                           and (run_dir / "ckpt.pt").exists()):
            time.sleep(0.001)
    finally:  # the job at once, workers and torchrun: its workers have sessions of their own
        for pid in [*Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split(), proc.pid]:
            os.kill(int(pid), signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "run.log").read_text()[-3000:]
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]  # whole: its shards match their digests
    resume = [a for a in args if not a.startswith(("max_steps", "ckpt_interval"))]
    train(2, [*resume, f"max_steps={step + 2}", "ckpt_interval=1", f"resume={run_dir}"], tmp_path)
    assert last_step(run_dir) == step + 2
    assert os.listdir(shards) == [Path(load_checkpoint(run_dir / "ckpt.pt")["shards"]["dir"]).name]


def sharded_checkpoint(run_dir: Path) -> Path:
    """A real one of a single process: a few tensors through DCP, ckpt.pt naming them."""
    run_dir.mkdir()
    state = {"model": {"w": torch.randn(64, 8)}, "optimizer": {"state": {"w": {"exp_avg": torch.randn(64, 8)}}}}
    par = Parallel(0, 1, 0, torch.device("cpu"), 1, 0, None, False)
    shards = save_shards(run_dir, 7, state, par)
    save_checkpoint(run_dir / "ckpt.pt", {"step": 7, "model": {}, "optimizer": {}, "loader": {}, "best_val_loss": 1.0,
                                          "rng": {}, "config": {}, "world_size": 2, "data_parallel": 2,
                                          "wandb_id": None, "grad_scaler": {}, "shards": shards})
    return run_dir / "ckpt.pt"


@pytest.mark.parametrize("damage", ["flipped bits", "truncated", "removed", "a stranger", "directory gone"])
def test_a_damaged_shard_directory_is_refused_in_one_line(damage, tmp_path):
    path = sharded_checkpoint(tmp_path / "run")
    directory = load_checkpoint(path)["shards"]["path"]
    shard = next(directory.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    if damage == "flipped bits":
        raw[len(raw) // 2] ^= 0x10
        shard.write_bytes(bytes(raw))
        said = f"its shard {shard} does not match the checksum written with it"
    elif damage == "truncated":
        shard.write_bytes(bytes(raw[:len(raw) // 2]))
        said = f"its shard {shard} does not match the checksum written with it"
    elif damage == "removed":
        shard.unlink()
        said = f"its shard directory {directory} lacks {shard.name}"
    elif damage == "a stranger":
        (directory / "__9_0.distcp").write_bytes(b"x")
        said = f"its shard directory {directory} has unknown __9_0.distcp"
    else:
        shutil.rmtree(directory)
        said = f"its shard directory {directory} is missing"
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(e.value) == f"checkpoint {path} cannot be loaded: {said}; nothing can be loaded from it"


def test_export_makes_one_file_of_the_shards_and_refuses_what_is_one_already(tmp_path):
    path = sharded_checkpoint(tmp_path / "run")
    done = script("export_checkpoint.py", str(tmp_path / "run"), "--out", str(tmp_path / "whole.pt"), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith(f"wrote {tmp_path / 'whole.pt'}"), done.stderr
    whole, shards = load_checkpoint(tmp_path / "whole.pt"), load_checkpoint(path)["shards"]
    assert whole["shards"] is None and whole["step"] == 7 and not list(tmp_path.glob(".whole.pt.*"))
    model = {"w": torch.empty(64, 8)}
    load_shards(shards["path"], {"model": model})
    assert torch.equal(whole["model"]["w"], model["w"]) and whole["optimizer"]["state"]["w"]["exp_avg"].shape == (64, 8)
    again = script("export_checkpoint.py", str(tmp_path / "whole.pt"), cwd=tmp_path)
    assert again.returncode == 2 and again.stderr == (f"error: {tmp_path / 'whole.pt'} already holds its weights and "
                                                      "optimizer state: it is one file\n")
