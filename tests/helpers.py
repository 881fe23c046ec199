"""Helpers the test files share: composing configs as train.py does, a CPU-sized model, reading a run's
outputs, starting a program and stopping it with real signals, the error bound of a low-precision
result against its float64 reference, and the attention kernels' inputs and float64 checks."""

import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

import kernels
from configs.store import register_configs
from kernels.reference.flash_ref import attention_probs, attention_reference
from model.config import ModelConfig
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


def torchrun(n: int, args: list[str], cwd: Path, timeout: int = 900, env: dict | None = None) -> str:
    """Runs `torchrun --standalone --nproc_per_node=n ARGS` (a script and its arguments) in cwd, with the
    repo importable (env: the environment, default this one's); its stdout, or the test fails with the
    end of stderr if it does not exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]
    done = subprocess.run(cmd, cwd=cwd, env={**(env or os.environ), "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def curve(run_dir: Path) -> list[tuple]:
    """The run's training and validation records (not its events: a stop, a divergence)."""
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in metrics(run_dir)
            if "event" not in r]


def last_step(run_dir: Path) -> int:
    """The last step the run logged a loss for (0 before its first)."""
    return max((r["step"] for r in metrics(run_dir) if "loss" in r), default=0)


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


def tiny_config(**overrides) -> ModelConfig:
    """A two-layer GPT's ModelConfig, these fields overridden."""
    base = dict(name="test", n_layer=2, n_head=4, d_model=64, max_seq_len=64, vocab_size=50257)
    return ModelConfig(**{**base, **overrides})


# --------------------------------------------------------------------------------------------
# the attention kernels against float64


def make_inputs(case_id, B, H, H_kv, T, S, D, dtype, layout, device="cpu"):
    """q (B, H, T, D), k, v (B, H_kv, S, D) and dO, seeded from the case id, as views of
    gradient-carrying leaves:
      contiguous: (B, H, T, D) tensors;
      bthd:       (B, T, H, D) tensors viewed as (B, H, T, D), dO too;
      packed:     slices of one (B, T, H + 2 H_kv, D) tensor, as a fused qkv projection gives.
    """
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if layout == "contiguous":
        q, k, v = (randn(*shape).requires_grad_() for shape in ((B, H, T, D), (B, H_kv, S, D), (B, H_kv, S, D)))
        return q, k, v, randn(B, H, T, D)
    if layout == "bthd":
        leaves = [randn(B, T, H, D), randn(B, S, H_kv, D), randn(B, S, H_kv, D)]
        q, k, v = (t.requires_grad_().transpose(1, 2) for t in leaves)
        return q, k, v, randn(B, T, H, D).transpose(1, 2)
    assert layout == "packed" and T == S, layout
    qkv = randn(B, T, H + 2 * H_kv, D).requires_grad_()
    q, k, v = qkv.split([H, H_kv, H_kv], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), randn(B, T, H, D).transpose(1, 2)


def dense_reference(q, k, v, do, causal, dtype, doc_ids=None, window=0):
    """(o, lse, dq, dk, dv) of the dense reference with every op in `dtype`."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(q, k, v, causal, dtype=dtype, doc_ids=doc_ids, window=window)
    return (o.detach(), lse, *torch.autograd.grad(o, (q, k, v), do.to(dtype)))


def error_scales(q, k, v, do, causal, doc_ids=None, window=0):
    """(o, lse, dq, dk, dv) maxima with every factor replaced by its absolute value (P |V| for
    P V, ...), in float64: the size of the sums each output is made of, which sets the scale of
    their rounding error even where they cancel (dQ is exactly 0 when S = 1)."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    B, H, _, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    p, lse = attention_probs(q, k, causal, doc_ids=doc_ids, window=window)  # (B, H, T, S)
    k_h, v_h = (t.repeat_interleave(H // H_kv, dim=1).abs() for t in (k, v))
    o = p @ v_h
    ds = p * (do.abs() @ v_h.transpose(-1, -2) + (do.abs() * o).sum(-1, keepdim=True))  # |P| (|dP| + |delta|)
    dq = D**-0.5 * ds @ k_h
    dk = D**-0.5 * (ds.transpose(-1, -2) @ q.abs()).view(B, H_kv, H // H_kv, S, D).sum(2)
    dv = (p.transpose(-1, -2) @ do.abs()).view(B, H_kv, H // H_kv, S, D).sum(2)
    lse = lse[torch.isfinite(lse)].abs()
    return tuple(t.max().item() if t.numel() else 0.0 for t in (o, lse, dq, dk, dv))


def assert_within_reference_error(name, got, ref64, ref_lowp, dtype, n_terms, error_scale):
    """max |got - ref64| <= 2 max |ref_lowp - ref64| + (eps(dtype) + sqrt(n_terms) eps(fp32)) error_scale.

    ref_lowp is PyTorch's own dense attention with every op in the input dtype: its error is
    what that dtype costs. The floor covers what that measure can miss: rounding the result to
    `dtype` costs up to half an ulp even where the reference is exact (a row that attends one
    key returns v); and the kernels add n_terms products one tile after another in fp32, whose
    rounding error grows like sqrt(n) eps(fp32) relative (Higham & Mary 2019), a little more
    than BLAS's blocked sums in the fp32 reference. error_scale is from error_scales.
    """
    assert got.shape == ref64.shape, name
    finite = torch.isfinite(ref64)  # only the LSE of rows that see no key is -inf
    assert torch.equal(got[~finite], ref64[~finite].to(got.dtype)), f"{name}: rows that see no key differ"
    if not finite.any():
        return
    got, ref64, ref_lowp = got[finite].double(), ref64[finite], ref_lowp[finite].double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - ref64).abs().max().item()
    ref_err = (ref_lowp - ref64).abs().max().item()
    floor = (torch.finfo(dtype).eps + n_terms**0.5 * torch.finfo(torch.float32).eps) * error_scale
    assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} > 2 * reference error {ref_err:.3g} + {floor:.3g}"


def check_against_float64(case_id, B, H, H_kv, T, S, D, causal, dtype, layout, device="cpu", doc_ids=None,
                           window=0, backend="triton"):
    q, k, v, do = make_inputs(case_id, B, H, H_kv, T, S, D, dtype, layout, device)
    o = kernels.flash_attention(q, k, v, causal=causal, doc_ids=doc_ids, window=window, backend=backend)
    grads = torch.autograd.grad(o, (q, k, v), do)
    _, lse = kernels.flash_attn_forward(q.detach(), k.detach(), v.detach(), causal, doc_ids=doc_ids,
                                        window=window, backend=backend)

    assert o.dtype == dtype and all(g.dtype == dtype for g in grads)
    ref64 = dense_reference(q, k, v, do, causal, torch.float64, doc_ids, window)
    ref_lowp = dense_reference(q, k, v, do, causal, dtype, doc_ids, window)
    # fp32 sums in the kernels: over the keys for O, LSE and dQ; over the queries of the whole
    # GQA group for dK and dV
    n_terms = (S, S, S, T * H // H_kv, T * H // H_kv)
    scales = error_scales(q, k, v, do, causal, doc_ids, window)
    outputs = zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), ref64, ref_lowp, n_terms, scales, strict=True)
    for name, got, want, lowp, n, scale in outputs:
        assert_within_reference_error(name, got, want, lowp, dtype, n, scale)


def case_id(dtype, B, H, H_kv, T, S, D, causal, layout):
    mask = "causal" if causal else "full"
    return f"{str(dtype)[6:]}-B{B}H{H}kv{H_kv}-T{T}S{S}-D{D}-{mask}-{layout}"


def doc_ids_of(lengths_per_batch, device="cpu"):
    """(B, T) document ids of consecutive documents of the given lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in lengths_per_batch]).to(device)


def poisoned(*tensors: torch.Tensor, where: slice) -> list[torch.Tensor]:
    """Copies of (B, H, T, D) tensors holding NaN at the sequence positions `where`, leaves that take
    gradients: a kernel that loads a tile it should skip, and only masks it, multiplies NaN into its
    sums (0 * NaN)."""
    copies = []
    for t in tensors:
        with torch.no_grad():
            copy = t.detach().clone()
            copy[:, :, where] = float("nan")
        copies.append(copy.requires_grad_())
    return copies


def assert_right_where_seen(got, want, rows: slice, atol: float | None = 1e-5) -> None:
    """Each of got, at the sequence positions `rows` (those that see no poisoned tile), finite and
    within atol of the reference (None: the same bits as it)."""
    for g, w in zip(got, want, strict=True):
        g, w = g[:, :, rows], w[:, :, rows]
        assert torch.isfinite(g).all(), "NaN leaked through a tile that should have been skipped"
        assert torch.equal(g, w) if atol is None else torch.allclose(g.double(), w.double(), atol=atol)
