"""Helpers the test files share: composing configs as train.py does, a CPU-sized model, reading a run's
outputs, starting a program and stopping it with real signals, and the error bound of a
low-precision result against its float64 reference."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from configs.store import register_configs
from trainer.metrics import read_metrics

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


# the repo importable, one BLAS thread (a load-adaptive one would sum in another order run to run)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """`python ARGS` in cwd, its stdout in cwd/out.log and stderr in cwd/err.log; SIGINT as a
    terminal's Ctrl-C delivers it (a background test process may have it ignored)."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=open(cwd / "out.log", "w"),
                            stderr=open(cwd / "err.log", "w"), env={**ENV, **(env or {})},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc: subprocess.Popen, cwd: Path, event, what: str, log: str = "err.log") -> None:
    """Until event() holds, the process still running (10 minutes at most); cwd / log says why not."""
    deadline = time.monotonic() + 600
    while not event():
        assert proc.poll() is None, f"{what}: the process ended first: {(cwd / log).read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{what}: not within 10 minutes: {(cwd / log).read_text()[-2000:]}"
        time.sleep(0.002)


def catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler of its own for sig (the kernel's SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def private_tmpfs_works() -> bool:
    """Whether this machine lets a process mount a tmpfs of its own (unshare -rm: a user and mount
    namespace of its own), for tests that need a small real disk."""
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


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


def assert_within_own_error(name: str, got: torch.Tensor, ref64: torch.Tensor, own: torch.Tensor,
                            n_terms: int = 1, dtype: torch.dtype = torch.float32,
                            own_ref64: torch.Tensor | None = None) -> None:
    """max |got - ref64| <= 2 max |own - own_ref64| + sqrt(n_terms) eps(dtype) max |ref64|.

    `own` is the textbook computation of the same value in the same precision (PyTorch's own
    ops), and own_ref64 its float64 reference (ref64 unless `own` ran at other inputs), so their
    distance is what that precision costs on this machine and its BLAS; `got` may sum in another
    order, but not be much further off. The floor covers what one comparison can miss: a sum of
    n_terms values of the reference's size rounds by up to ~sqrt(n_terms) eps relative in any
    order, even where `own` happened to land closer. NaN or inf never passes.
    """
    own_ref64 = ref64 if own_ref64 is None else own_ref64
    assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref64).abs().max().item()
    own_err = (own.double() - own_ref64).abs().max().item()
    floor = n_terms**0.5 * torch.finfo(dtype).eps * ref64.abs().max().item()
    assert err <= 2 * own_err + floor, f"{name}: error {err:.3g} > 2 x own error {own_err:.3g} + {floor:.3g}"
