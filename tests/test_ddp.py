"""Data-parallel training under torchrun on the CPU (gloo): one output, the same math as one process.

A 2-process run must leave one run dir and one W&B run (rank 0 owns both), and since DDP
averages gradients over the global batch, its losses after the first update must equal those
of a single process that trains on the same global batch.
    .venv/bin/python -m pytest tests/test_ddp.py -q
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import train as train_module
from configs.validate import ConfigError, batch_size_per_process, validate
from tests.helpers import REPO, TINY, compose, metrics


@pytest.mark.slow
def test_two_processes_write_one_run_and_match_one_process(data_root, tmp_path):
    common = TINY + [f"data.root={data_root}", "batch_tokens=256", "max_steps=3", "log_interval=1",
                     "eval_interval=0", "wandb.mode=offline"]
    workdir, run_dir = tmp_path / "cwd", tmp_path / "ddp"
    workdir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "train.py"), *common, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, cwd=workdir, env=env, check=True, capture_output=True, timeout=600)
    assert list(workdir.iterdir()) == []  # no rank made a Hydra dir of its own
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1
    ddp = [r for r in metrics(run_dir) if "loss" in r]
    assert ddp[0]["tokens_per_s"] == pytest.approx(2 * ddp[0]["tokens_per_s_per_gpu"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_per_step"] == 256

    train_module.train(compose(common + ["wandb.mode=disabled"]), tmp_path / "single")
    single = [r for r in metrics(tmp_path / "single") if "loss" in r]
    # same windows, same weights: the global-batch mean and the mean of two half-batch means
    # differ by fp32 rounding only (a few ulps, ~1e-7), carried through two AdamW updates
    for a, b in zip(single, ddp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0), a["step"]


def test_world_size_must_divide_the_global_batch():
    cfg = compose(TINY + ["batch_tokens=256"])  # 8 sequences of 32
    with pytest.raises(ConfigError, match="batch_tokens=256: must be a multiple of seq_len x data-parallel processes = 32 x 3"):
        validate(cfg, world=3)
    validate(cfg, world=2)
    assert batch_size_per_process(cfg, world=2) == 4


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="needs GPU 1, but only 1 are visible: lower --nproc_per_node"):
        train_module.setup_distributed(compose(TINY[:-1]))
