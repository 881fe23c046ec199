"""Context parallelism on the CPU: gloo, Triton's interpreter, fp32, real processes under torchrun.

Ring attention over zigzag shards must give what attention over the whole sequence gives (the
float64 reference, with tests/helpers.py's error bound), and a training run that splits every
sequence over 2 or 4 processes must log the losses and gradient norms of one process that trains
on the same batches, to fp32 rounding. Torch's context parallelism (attn=sdpa) runs SDPA's CUDA
kernels only: on the CPU its split (the same zigzag) and its config rules are checked; its
training, on two GPUs.
    .venv/bin/python -m pytest tests/test_context_parallel.py -q
"""

import json
import re

import pytest
import torch

import train as train_module
from configs.validate import ConfigError, batch_size_per_process, validate
from trainer.parallel import ContextParallel, unshard
from tests.helpers import (REPO, TINY, assert_within_reference_error, compose, dense_reference, error_scales, metrics,
                           torchrun)
from tests.ring_worker import inputs


def test_shard_and_unshard_are_inverse_and_positions_are_global():
    x = torch.arange(2 * 24).view(2, 24)
    shards = [ContextParallel(None, r, 3).shard(x) for r in range(3)]
    assert shards[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of six
    assert torch.equal(unshard(shards), x)
    positions = [ContextParallel(None, r, 3).positions(24, torch.device("cpu")) for r in range(3)]
    assert all(torch.equal(p, s[0]) for p, s in zip(positions, shards, strict=True))
    with pytest.raises(ValueError, match="needs a sequence length divisible by 6 .* got 25"):
        ContextParallel(None, 0, 3).shard(torch.zeros(1, 25))


def _check_ring(tmp_path, n, T, H, H_kv, D, device="cpu"):
    torchrun(n, [str(REPO / "tests" / "ring_worker.py"), str(tmp_path), str(T), str(H), str(H_kv), str(D), device],
              tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, do = inputs(T, H, H_kv, D, dtype)
    ref64 = dense_reference(q, k, v, do, True, torch.float64)
    ref_lowp = dense_reference(q, k, v, do, True, dtype)
    scales = error_scales(q, k, v, do, True)
    n_terms = (T, T, T, T * H // H_kv, T * H // H_kv)
    for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        got = unshard([r[name] for r in ranks], dim=2)
        assert_within_reference_error(name, got, ref64[i], ref_lowp[i], dtype, n_terms[i], scales[i])
        if name != "lse":  # autograd runs the same calls
            assert torch.equal(unshard([r[f"{name}_autograd"] for r in ranks], dim=2), got), name
        # heads in groups: the forward's merges may round an fp32 bit apart; from the same o and LSE,
        # the backward's sums are the same bits
        grouped = unshard([r[f"{name}_grouped"] for r in ranks], dim=2)
        assert torch.equal(grouped, got) if name.startswith("d") else \
            (grouped - got).abs().max() <= 2 ** -20 * got.abs().max(), name
    assert all(r["deterministic"] for r in ranks)
    assert all(r["bthd_layout"] for r in ranks)  # grouped or not, o comes out in the kernels' memory order


@pytest.mark.slow
@pytest.mark.parametrize(("n", "T", "H", "H_kv", "D"), [(2, 24, 4, 2, 16), (3, 18, 2, 2, 32), (4, 40, 4, 1, 16)],
                         ids=["2-ranks-gqa", "3-ranks-chunks-of-3", "4-ranks-mqa-chunks-of-5"])
def test_ring_attention_matches_whole_sequence_attention(tmp_path, n, T, H, H_kv, D):
    _check_ring(tmp_path, n, T, H, H_kv, D)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per GPU)")
@pytest.mark.parametrize(("T", "H", "H_kv", "D"), [(4 * 300, 4, 2, 64), (4 * 129, 2, 2, 128)])
def test_ring_attention_on_gpus_matches_whole_sequence_attention(tmp_path, T, H, H_kv, D):
    _check_ring(tmp_path, 2, T, H, H_kv, D, "cuda")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_rings_bf16_sums_are_its_fp32_sums_rounded_once(tmp_path, n):
    torchrun(n, [str(REPO / "tests" / "ring_bf16_worker.py"), str(tmp_path)], tmp_path)
    for r in range(n):
        assert all(torch.load(tmp_path / f"rank{r}.pt").values()), (r, torch.load(tmp_path / f"rank{r}.pt"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_two_bf16_terms_add_as_their_fp32_sum_rounded_once(device):
    # what lets the ring keep a sum of two terms (dQ, dK/dV with 2 ranks) in the inputs' dtype with the
    # bits of an fp32 sum: PyTorch adds bf16 in fp32 and rounds once, also in place on a strided view
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 64, 256, generator=gen) * 2.0 ** torch.randint(-30, 30, (4, 64, 256), generator=gen)
            for _ in range(2))
    a, b = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
    want = (a.float() + b.float()).to(torch.bfloat16)
    assert torch.equal(a + b, want)
    into = a.transpose(1, 2).contiguous().transpose(1, 2)  # a's values, strided as a kernel's output may be
    into[:, :, 100:] += b[:, :, 100:]
    assert torch.equal(into[:, :, 100:], want[:, :, 100:]) and torch.equal(into[:, :, :100], a[:, :, :100])


@pytest.mark.slow
def test_the_ring_memory_script_prints_each_ranks_peaks(tmp_path):
    out = torchrun(2, [str(REPO / "scripts" / "ring_memory.py"), "--tokens", "256", "--heads", "2", "--head-dim", "16",
                       "--head-groups", "1,2"], tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    seen = sorted(re.match(r"rank (\d) of 2, 256 tokens, head groups (\d): ", line).groups() for line in lines)
    assert seen == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")], out
    assert all("one process " in line and "; ring " in line for line in lines), out


def test_a_shard_must_hold_two_equal_chunks():
    from kernels.ring_attention import ring_attn_forward

    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"must hold the same even number of tokens: two zigzag chunks"):
        ring_attn_forward(q, q, q, group=None)


CP_RUN = TINY + ["attn=triton", "model.n_layer=2", "batch_tokens=128", "max_steps=3", "log_interval=1",
                 "eval_interval=0", "wandb.mode=disabled", "ckpt_interval=-1"]


@pytest.mark.slow
@pytest.mark.parametrize(("n", "cp", "extra"), [(2, 2, ["model.pos_emb=rope", "ac=selective",
                                                         "parallel.cp_head_groups=2"]), (4, 2, ["ac=full"]),
                                                (4, 4, ["model.n_kv_head=1"]), (2, 2, ["compile=true"]),
                                                (2, 2, ["ac=offload", "model.mlp_chunk=5"])],
                         ids=["cp2-rope-selective-ac-head-groups", "dp2-cp2-full-ac", "cp4-mqa", "cp2-compiled",
                              "cp2-offload-tiled-mlp"])
def test_context_parallel_training_matches_one_process(data_root, tmp_path, n, cp, extra):
    common = CP_RUN + [f"data.root={data_root}"] + extra
    torchrun(n, [str(REPO / "train.py"), *common, f"parallel.cp={cp}", f"hydra.run.dir={tmp_path / 'cp'}"], tmp_path)
    summary = json.loads((tmp_path / "cp" / "summary.json").read_text())
    assert (summary["world_size"], summary["cp"], summary["tokens_per_step"]) == (n, cp, 128)
    train_module.train(compose([a for a in common if not a.startswith("parallel.")]), tmp_path / "single")
    single, split = metrics(tmp_path / "single"), metrics(tmp_path / "cp")
    assert len(single) == len(split) == 4  # three steps and the final validation
    for a, b in zip(single, split, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:  # fp32: the same sums, split over ranks and merged by LSE, round differently
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=0), (a["step"], key)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per GPU)")
@pytest.mark.parametrize(("attn", "extra"), [("triton", []), ("sdpa", []), ("triton", ["model.n_kv_head=1"]),
                                             ("sdpa", ["model.n_kv_head=1"])],
                         ids=["ours", "torch", "ours-mqa", "torch-mqa"])
def test_context_parallel_training_on_two_gpus_matches_one(data_root, tmp_path, attn, extra):
    common = TINY[:-1] + [f"attn={attn}", "model.pos_emb=rope", "seq_len=512", "model.max_seq_len=512",
                          "batch_tokens=2048", "max_steps=3", "log_interval=1", "eval_interval=0",
                          "wandb.mode=disabled", "ckpt_interval=-1", f"data.root={data_root}", *extra]
    torchrun(2, [str(REPO / "train.py"), *common, "parallel.cp=2", f"hydra.run.dir={tmp_path / 'cp'}"], tmp_path)
    train_module.train(compose(common), tmp_path / "single")
    single, split = metrics(tmp_path / "single"), metrics(tmp_path / "cp")
    for a, b in zip(single, split, strict=True):  # bf16 autocast: the same math, rounded differently
        for key in ("loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=2e-2), (a["step"], key)


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["parallel.cp=2"], 1, r"parallel.cp=2: must divide the number of processes, 1: run under torchrun "
                           r"--nproc_per_node=<a multiple of 2>"),
    (["parallel.cp=2", "attn=naive"], 2, r"parallel.cp=2: needs attn=sdpa, attn=triton .*attn=naive cannot split"),
    (["parallel.cp=2", "attn=sdpa"], 2, r"parallel.cp=2: with attn=sdpa is torch's context parallelism, which runs "
                                        r"SDPA's CUDA kernels only \(flash, efficient, cuDNN\): use a CUDA device, "
                                        r"or attn=triton"),
    (["parallel.cp=2", "attn=triton", "parallel.cp_rotate=alltoall"], 2,
     r"parallel.cp_rotate=alltoall: is how torch's context parallelism \(attn=sdpa\) passes K/V; attn=triton does not "
     r"use it: drop it"),
    (["attn=sdpa", "parallel.cp_rotate=alltoall"], 1,
     r"parallel.cp_rotate=alltoall: is how the ranks of a split sequence pass K/V: add parallel.cp=N \(N > 1\), or "
     r"drop it"),
    (["parallel.cp=2", "attn=triton", "seq_len=30"], 2, r"seq_len=30: must be a multiple of 2 x parallel.cp = 4"),
    (["parallel.cp=2", "attn=triton", "data.doc_mask=true"], 2, r"data.doc_mask=True: is not supported with "
                                                                r"parallel.cp > 1"),
    (["parallel.cp=2", "attn=triton", "attn.window=16"], 2, r"attn.window=16: is not supported with parallel.cp > 1"),
    (["parallel.cp=0"], 1, r"parallel.cp=0: must be at least 1"),
    (["parallel.cp=2", "attn=triton", "parallel.cp_head_groups=0"], 2, r"parallel.cp_head_groups=0: must be at "
                                                                       r"least 1"),
    (["parallel.cp_head_groups=2"], 1, r"parallel.cp_head_groups=2: is how our ring attention splits its heads: it "
                                       r"needs attn=triton and parallel.cp=N \(N > 1\)"),
    (["parallel.cp=2", "attn=triton", "model.n_head=4", "model.n_kv_head=2", "parallel.cp_head_groups=4"], 2,
     r"parallel.cp_head_groups=4: must divide the model's 2 K/V heads"),
    (["parallel.cp=2", "attn=triton", "batch_tokens=32"], 4, r"batch_tokens=32: must be a multiple of seq_len x "
                                                             r"data-parallel processes = 32 x 2"),
])
def test_context_parallel_config_errors(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(TINY + overrides), world)


def test_torch_context_parallelism_refuses_sdpa_without_a_ring_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cfg = compose(TINY[:-1] + ["device=cuda", "attn=sdpa", "parallel.cp=2", "parallel.cp_rotate=alltoall"])
    validate(cfg, world=2)
    cfg.attn.sdpa_backend = "math"
    with pytest.raises(ConfigError, match=r"attn.sdpa_backend=math: has no ring in torch's context parallelism: "
                                          r"choose flash, efficient, cudnn or null with parallel.cp > 1"):
        validate(cfg, world=2)


@pytest.mark.slow
def test_torch_context_parallelism_splits_as_our_ring_does(tmp_path):
    torchrun(3, [str(REPO / "tests" / "split_worker.py"), str(tmp_path), "24"], tmp_path)
    for r in range(3):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["patched"] and got["restored"], r  # torch's SDPA inside the split only
        # the tokens, their targets and their positions sharded alike, in our ring's zigzag layout
        assert torch.equal(got["x"], got["whole_x"][:, got["pos"]]), r
        assert torch.equal(got["y"], got["whole_y"][:, got["pos"]]), r
        assert torch.equal(got["x"], got["zigzag"]), r


def test_the_ranks_of_one_sequence_share_its_batch():
    cfg = compose(TINY + ["attn=triton", "parallel.cp=2", "batch_tokens=128"])
    validate(cfg, world=4)
    assert batch_size_per_process(cfg, world=4) == 2  # 2 data-parallel rows of 2 sequences
