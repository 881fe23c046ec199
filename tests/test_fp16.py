"""dtype=float16: fp16 autocast with dynamic loss scaling, for GPUs without bf16 (T4, V100), run on the CPU.

- dtype=auto picks bf16 from CUDA compute capability 8.0, fp16 below it and fp32 on the CPU, and
  says so in one line; bfloat16 on an older GPU is refused in one line (the capability mocked);
- a tiny fp16 run trains, and its checkpoint holds the loss scale (an fp32 run's holds none); a
  checkpoint of format 1, from before the loss scale, or of format 2, from before shards, still resumes;
- an fp16 resume continues bit for bit, the loss scale and its growth tracker restored;
- a step whose scaled gradients overflow is skipped and the scale halved, not called divergence;
  a loss that is not finite still is.
    .venv/bin/python -m pytest tests/test_fp16.py -q
"""

import math

import pytest
import torch

import train as train_module
from configs.runtime import autocast_dtype, grad_scaler, precision_line
from configs.validate import ConfigError, validate
from data import TokenWindows
from tests.helpers import TINY, compose, metrics
from trainer import checkpoint

FP16 = TINY + ["dtype=float16", "log_interval=1", "eval_interval=0", "wandb.mode=disabled"]


def scaler_from(init_scale: float, growth_interval: int = 2000):
    """grad_scaler as train.py calls it, starting at init_scale: forces overflows on a tiny model."""
    def make(dtype: str, device: torch.device) -> torch.amp.GradScaler:
        assert grad_scaler(dtype, device).is_enabled()
        return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    return make


# ----------------------------------------------------------------------------- what dtype means where


@pytest.mark.parametrize("capability, want, line", [
    ((7, 0), torch.float16, "dtype=auto: float16 (CUDA capability 7.0, dynamic loss scaling)"),
    ((7, 5), torch.float16, "dtype=auto: float16 (CUDA capability 7.5, dynamic loss scaling)"),
    ((8, 0), torch.bfloat16, "dtype=auto: bfloat16 (CUDA capability 8.0)"),
    ((9, 0), torch.bfloat16, "dtype=auto: bfloat16 (CUDA capability 9.0)"),
])
def test_dtype_auto_on_a_gpu_follows_its_compute_capability(capability, want, line, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    assert autocast_dtype("auto", cuda) == want and precision_line("auto", cuda) == line
    assert autocast_dtype("float16", cuda) == torch.float16 and autocast_dtype("float32", cuda) is None


def test_dtype_auto_on_the_cpu_is_fp32_and_only_fp16_scales_the_loss():
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None and precision_line("auto", cpu) == "dtype=auto: float32 (CPU)"
    assert (autocast_dtype("bfloat16", cpu), autocast_dtype("float16", cpu)) == (torch.bfloat16, torch.float16)
    scaled = [d for d in ("auto", "float32", "bfloat16", "float16") if grad_scaler(d, cpu).is_enabled()]
    assert scaled == ["float16"]


def test_bfloat16_on_a_gpu_before_compute_capability_8_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ConfigError, match=r"^dtype=bfloat16: needs a GPU of compute capability 8.0 or newer "
                                          r"\(bf16 tensor cores\); cuda is 7.5: use dtype=float16 or auto$"):
        validate(compose(TINY[:-1] + ["device=cuda", "dtype=bfloat16"]))
    validate(compose(TINY[:-1] + ["device=cuda", "dtype=float16"]))


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_tiny_fp16_run_learns_and_checkpoints_its_loss_scale(dtype, data_root, tmp_path, capsys):
    summary = train_module.train(compose(FP16 + [f"data.root={data_root}", "max_steps=8", f"dtype={dtype}"]),
                                 tmp_path)
    losses = [r["loss"] for r in metrics(tmp_path) if "loss" in r]
    assert summary["status"] == "ok" and summary["precision"] == dtype and len(losses) == 8
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dtype=")]
    assert said == [f"dtype={dtype}: {dtype} (CPU{', dynamic loss scaling' if dtype == 'float16' else ''})"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    if dtype == "float32":  # no scaler: nothing to restore
        assert state["grad_scaler"] == {}
        return
    # the default scale never overflowed here: 8 clean steps counted towards the next growth
    assert state["grad_scaler"] == {"scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                                    "growth_interval": 2000, "_growth_tracker": 8}


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_from_before_the_loss_scale_or_shards_still_resumes(version, data_root, tmp_path):
    common = TINY + [f"data.root={data_root}", "eval_interval=0", "wandb.mode=disabled"]
    train_module.train(compose(common + ["max_steps=2"]), tmp_path)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    # format 1 had no loss scale and no format_version; format 2 had no shards
    for key in (("grad_scaler", "format_version") if version == 1 else ()) + ("shards", "sha256"):
        state.pop(key)
    if version == 2:
        state["format_version"] = 2
    state["sha256"] = checkpoint._digest(state)
    torch.save(state, tmp_path / "ckpt.pt")
    summary = train_module.train(compose(common + ["max_steps=4", f"resume={tmp_path}"]), tmp_path / "ignored")
    assert summary["status"] == "ok" and summary["steps"] == 4
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["format_version"] == checkpoint.FORMAT_VERSION


def test_an_fp16_resume_reproduces_the_uninterrupted_run_exactly(data_root, tmp_path, monkeypatch):
    # a scale that overflows at first and grows back every 2 clean steps: the scale and the growth
    # tracker at the checkpoint both differ from a fresh scaler's, so a resume that lost them would
    # skip other steps than the uninterrupted run
    monkeypatch.setattr("trainer.run.grad_scaler", scaler_from(2.0**24, growth_interval=2))
    common = FP16 + [f"data.root={data_root}", "max_steps=8", "eval_interval=4", "ckpt_interval=4",
                     "model.dropout=0.1"]
    train_module.train(compose(common), tmp_path / "straight")

    interrupted = tmp_path / "interrupted"
    real_next_batch = TokenWindows.next_batch
    calls = {"n": 0}

    def next_batch_then_interrupt(self):  # Ctrl-C during step 6, after the checkpoint at step 4
        if self.path.name == "train.bin":
            calls["n"] += 1
            if calls["n"] == 6:
                raise KeyboardInterrupt
        return real_next_batch(self)

    with monkeypatch.context() as m:
        m.setattr(TokenWindows, "next_batch", next_batch_then_interrupt)
        stopped = train_module.train(compose(common), interrupted)
    assert (stopped["status"], stopped["signal"], stopped["steps"]) == ("stopped", "SIGINT", 5)
    saved = torch.load(interrupted / "ckpt.pt", weights_only=True)
    assert saved["step"] == 4 and saved["grad_scaler"]["scale"] < 2.0**24, saved["grad_scaler"]

    train_module.train(compose(common + [f"resume={interrupted}"]), tmp_path / "ignored")
    want, got = metrics(tmp_path / "straight"), metrics(interrupted)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    overflowed = [r["step"] for r in want if "loss" in r and r["grad_norm"] is None]
    assert max(overflowed) > 4, f"no step after the checkpoint overflowed: {overflowed}"
    for a, b in zip(want, got):
        for key in ("loss", "val_loss", "grad_norm", "lr"):
            assert a.get(key) == b.get(key), (a["step"], key)  # bit-identical on the CPU


def test_an_fp16_overflow_skips_the_step_and_is_not_divergence(data_root, tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.run.grad_scaler", scaler_from(2.0**24))  # the tiny model's overflow from 2**21
    summary = train_module.train(compose(FP16 + [f"data.root={data_root}", "max_steps=8"]), tmp_path)
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert summary["status"] == "ok" and all(math.isfinite(r["loss"]) for r in rows)
    # an overflowing step logs no gradient norm (inf or NaN), updates nothing and halves the scale
    skipped = sum(r["grad_norm"] is None for r in rows)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert 0 < skipped < 8 and state["grad_scaler"]["scale"] == 2.0 ** (24 - skipped)
    assert all(s["step"] == 8 - skipped for s in state["optimizer"]["state"].values())  # AdamW's own count


def test_an_fp16_loss_that_is_not_finite_is_still_divergence(data_root, tmp_path):
    summary = train_module.train(compose(FP16 + [f"data.root={data_root}", "max_steps=8", "optim.lr=1e4",
                                                 "optim.warmup_steps=0"]), tmp_path)
    assert summary["status"] == "diverged", summary
    assert summary["message"].startswith("training diverged: the loss at step "), summary["message"]
