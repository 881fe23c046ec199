"""Helpers the test files share: composing configs as train.py does, a CPU-sized model, reading a run's outputs."""

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from configs.store import register_configs
from data.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# a one-layer model and short windows: a training step takes milliseconds on the CPU
TINY = ["model=tiny", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "seq_len=32", "batch_size=4",
        "eval_steps=2", "sample_tokens=0", "optim.warmup_steps=2", "optim.lr=1e-2", "device=cpu"]


def compose(overrides: list[str], config_name: str = "config", schema: type | None = None):
    """The config train.py (or a script with its own schema subclass) would run with these overrides."""
    register_configs(schema) if schema else register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(Path(run_dir) / "metrics.jsonl")


def wandb_file(run_dir: Path) -> Path:
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir}"
    return files[-1]


def torchrun(n: int, args: list[str], cwd: Path, timeout: int = 900) -> None:
    """Runs `torchrun --standalone --nproc_per_node=n ARGS` (a script and its arguments) in cwd, with the
    repo importable; fails the test with the end of stderr if it does not exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
