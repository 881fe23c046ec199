"""Data-parallel training under torchrun on the CPU (gloo): one output, the same math as one process.

A 2-process run must leave one run dir and one W&B run (rank 0 owns both), and since DDP
averages gradients over the global batch, its losses after the first update must equal those
of a single process that trains on the same global batch.
    .venv/bin/python -m pytest tests/test_ddp.py -q
"""

import json
import math

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import train as train_module
from configs.validate import ConfigError, batch_size_per_process, validate
from trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint
from trainer.parallel import fsdp_units
from tests.helpers import REPO, TINY, compose, metrics, torchrun


@pytest.mark.slow
def test_two_processes_write_one_run_and_match_one_process(data_root, tmp_path):
    common = TINY + [f"data.root={data_root}", "batch_tokens=256", "max_steps=3", "log_interval=1",
                     "eval_interval=0", "wandb.mode=offline"]
    workdir, run_dir = tmp_path / "cwd", tmp_path / "ddp"
    workdir.mkdir()
    torchrun(2, [str(REPO / "train.py"), *common, f"hydra.run.dir={run_dir}"], workdir, timeout=600)
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
    with pytest.raises(ConfigError, match="LOCAL_RANK=1: needs GPU 1, but only 1 are visible: lower "
                                          "--nproc_per_node"):
        validate(compose(TINY[:-1] + ["device=cuda"]), world=2)


FSDP_RUN = TINY + ["attn=triton", "model.n_layer=2", "batch_tokens=128", "log_interval=1", "eval_interval=2",
                   "wandb.mode=disabled", "ckpt_interval=3", "parallel.dp=fsdp", "sample_tokens=4"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["parallel.cp=2", "parallel.unit_params=1"], ["ac=offload", "model.mlp_chunk=5"],
                                   ["parallel.reshard_after_forward=false", "grad_accum=2", "parallel.unit_params=1"]],
                         ids=["fsdp", "fsdp-cp2-unit-per-block", "fsdp-offload-tiled-mlp",
                              "fsdp-kept-weights-accumulated-unit-per-block"])
def test_sharded_runs_match_one_process_and_resume_exactly(data_root, tmp_path, extra):
    common = FSDP_RUN + [f"data.root={data_root}"] + extra
    torchrun(2, [str(REPO / "train.py"), *common, "max_steps=5", f"hydra.run.dir={tmp_path / 'whole'}"], tmp_path, timeout=600)
    torchrun(2, [str(REPO / "train.py"), *common, "max_steps=3", f"hydra.run.dir={tmp_path / 'cut'}"], tmp_path, timeout=600)
    torchrun(2, [str(REPO / "train.py"), *common, "max_steps=5", f"resume={tmp_path / 'cut'}"], tmp_path, timeout=600)
    whole, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "cut")
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["sample"]  # every rank sampled
    # the 2 tiny blocks: one unit of both, unless each is asked to be its own
    assert summary["fsdp_blocks_per_unit"] == ([1, 1] if "parallel.unit_params=1" in extra else [2])
    # every rank reads its shards back from the checkpoint: the same run, bit for bit
    values = lambda records: [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records
                              if r["step"] > 3]
    assert values(resumed) == values(whole)
    plain = [a for a in common if not a.startswith("parallel.")]
    train_module.train(compose(plain + ["max_steps=5", "ckpt_interval=-1"]), tmp_path / "single")
    # the same gradients; the losses agree to fp32 rounding, the gradient norms to that of an fp32 norm
    # over 1.6M embedding-gradient elements (~1e-4: both are that far from the float64 norm)
    for a, b in zip(metrics(tmp_path / "single"), whole, strict=True):
        for key, rel in (("loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-3)):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=0), (a["step"], key)


def test_fsdp_units_are_consecutive_blocks_of_at_least_the_asked_parameters():
    blocks = [torch.nn.Linear(10, 10) for _ in range(5)]  # 110 parameters each
    ids = lambda units: [[blocks.index(b) for b in unit] for unit in units]
    assert ids(fsdp_units(blocks, 1)) == [[0], [1], [2], [3], [4]]
    assert ids(fsdp_units(blocks, 200)) == [[0, 1], [2, 3], [4]]
    assert ids(fsdp_units(blocks, 220)) == [[0, 1], [2, 3], [4]]
    assert ids(fsdp_units(blocks, 221)) == [[0, 1, 2], [3, 4]]
    assert ids(fsdp_units(blocks, 10**8)) == [[0, 1, 2, 3, 4]]


@pytest.mark.slow
@pytest.mark.parametrize(("max_norm", "unit_params"), [(math.inf, 1), (0.05, 10**8)], ids=["unclipped", "clipped"])
def test_sharded_adamw_and_clipping_on_local_shards_equal_torchs_over_dtensors(tmp_path, max_norm, unit_params):
    # 3 processes: shards of unequal sizes
    torchrun(3, [str(REPO / "tests" / "shard_worker.py"), str(tmp_path), str(max_norm), str(unit_params)], tmp_path)
    got = torch.load(tmp_path / "rank0.pt")
    (torch_norms, our_norms), (torch_weights, our_weights) = got["norms"], got["weights"]
    for a, b in zip(torch_norms, our_norms, strict=True):  # one fp32 sum in another order
        assert b.item() == pytest.approx(a.item(), rel=1e-6)
    assert max_norm == math.inf or all(n.item() > max_norm for n in torch_norms)  # clipping happened
    for name, a in torch_weights.items():
        if max_norm == math.inf:  # the same fused kernel on the same elements
            assert torch.equal(our_weights[name], a), name
        else:  # gradients scaled by coefficients an fp32 rounding apart, which AdamW's moments can
            # amplify where a gradient changes sign: a thousandth of one step (lr 1e-2) at most
            torch.testing.assert_close(our_weights[name], a, rtol=0, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.slow
def test_sharded_run_on_one_gpu_trains(data_root, tmp_path):
    args = TINY[:-1] + ["attn=triton", "max_steps=3", "log_interval=1", "eval_interval=0", "wandb.mode=disabled",
                        "ckpt_interval=-1", "sample_tokens=4", "parallel.dp=fsdp", f"data.root={data_root}",
                        f"hydra.run.dir={tmp_path / 'run'}"]
    torchrun(1, [str(REPO / "train.py"), *args], tmp_path, timeout=600)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["sample"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per GPU)")
def test_sharded_run_on_two_gpus_gathers_bf16_tracks_ddp_and_resumes_exactly(data_root, tmp_path):
    common = TINY[:-1] + ["attn=triton", "model.n_layer=2", "batch_tokens=128", "log_interval=1", "eval_interval=2",
                          "wandb.mode=disabled", "ckpt_interval=3", "sample_tokens=0", f"data.root={data_root}"]
    sharded = common + ["parallel.dp=fsdp"]  # param_dtype=auto: bf16 gathers
    run = lambda args, steps, name: torchrun(2, [str(REPO / "train.py"), *args, f"max_steps={steps}",
                                                 f"hydra.run.dir={tmp_path / name}"], tmp_path, timeout=600)
    run(sharded, 5, "whole")
    run(sharded, 3, "cut")
    torchrun(2, [str(REPO / "train.py"), *sharded, "max_steps=5", f"resume={tmp_path / 'cut'}"], tmp_path,
             timeout=600)
    run(common, 5, "ddp")
    shards = load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)["shards"]["path"]
    stored = FileSystemReader(shards).read_metadata().state_dict_metadata
    assert {m.properties.dtype for key, m in stored.items() if key.startswith("model.")} == {torch.float32}  # kept fp32
    whole, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "cut")
    values = lambda records: [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records
                              if r["step"] > 3]
    assert values(resumed) == values(whole)
    # bf16 autocast either way; FSDP's LayerNorm gains arrive rounded to bf16
    for a, b in zip(metrics(tmp_path / "ddp"), whole, strict=True):
        for key in ("loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=2e-2), (a["step"], key)


@pytest.mark.parametrize(("override", "said"), [("parallel.param_dtype=float32", "parallel.param_dtype=float32"),
                                               ("parallel.reshard_after_forward=false",
                                                "parallel.reshard_after_forward=False"),
                                               ("parallel.unit_params=1", "parallel.unit_params=1")])
def test_fsdp_settings_need_fsdp(override, said):
    with pytest.raises(ConfigError, match=f"{said}: sets how FSDP gathers weights: add parallel.dp=fsdp, or drop it"):
        validate(compose(TINY + [override]))


def test_fsdp_units_hold_at_least_one_parameter(monkeypatch):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # as torchrun sets them
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"parallel.unit_params=0: must be at least 1 \(1: each block its own FSDP unit\)"):
        validate(compose(TINY + ["parallel.dp=fsdp", "parallel.unit_params=0"]))


def test_sharding_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"parallel.dp=fsdp: shards the model over torchrun's processes"):
        validate(compose(TINY + ["parallel.dp=fsdp"]))
