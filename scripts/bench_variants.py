"""Benchmark the Hopper kernels' schedule variants against each other and the peers, in one process.

Each variant is an environment variable kernels/hopper/config.py reads per call (FLASH_ATTENTION_
FWD_ORDER, _FWD_OVERLAP, _FWD_STAGES, _FWD_PERSISTENT, _FWD_TURNS, _FWD_EXP2_FMA, _BWD_BY_KEYS,
_BWD_ORDER, _BWD_PERSISTENT). The forward's baseline is the kernel before them ("before": head by
head, a program per tile, each block's P V after its softmax, a 2-deep K/V ring at D = 128, every
exponential on the exp2 unit); the persistent kernels', a program per tile;
the backward's (at D = 64, where it has two forms) is by rows, the default before v29; the order's
(both head dims) is shortest first, the order before v19. Inputs as `bench_attention.py --layout
btHd`: causal bf16, q, k, v views of one (B, T, 3, H, D) tensor as the model makes them,
B·T = 16384, H·D = 1024. Prints TFLOP/s forward and forward+backward (3.5× the forward's FLOPs),
each row's ratio to the first row of its group, and the largest difference of o, dq, dk, dv to it
(0 where a variant only reorders work); cuDNN and FlashAttention-4 (where installed) close each
(D, T). With --documents or --window (or both: the window within the documents), B = 1 and
T = 32768 unless --seq-lens says otherwise, the mask as `bench_attention.py --documents synthetic`
and `--window` make it, TFLOP/s of the pairs it leaves, and FlashAttention-4 with the same mask
(its varlen entry for the documents, window_size for the window) closes each (D, T); SDPA's cuDNN
backend takes no such mask.

    python scripts/bench_variants.py
    python scripts/bench_variants.py --head-dims 64 --seq-lens 8192 --groups backward
    python scripts/bench_variants.py --documents --window 1024 --groups default,persistent
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import attention_flops, backends, flash_attention  # noqa: E402
from kernels.hopper import config as hopper  # noqa: E402
from model.peers import fa4_attention, fa4_unsupported  # noqa: E402
from scripts.args import ArgumentParser, positive_int, positive_ints, require_cuda  # noqa: E402
from scripts.bench_attention import document_ids, document_lengths, environ, environment  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402

FWD, BACKEND, BY_KEYS = hopper.FWD_ORDER_VARIABLE, backends.BACKEND_VARIABLE, hopper.BWD_BY_KEYS_VARIABLE
OVERLAP, STAGES, ORDER = hopper.FWD_OVERLAP_VARIABLE, hopper.FWD_STAGES_VARIABLE, hopper.BWD_ORDER_VARIABLE
PERSISTENT, BWD_PERSISTENT = hopper.FWD_PERSISTENT_VARIABLE, hopper.BWD_PERSISTENT_VARIABLE
TURNS, EXP2_FMA = hopper.FWD_TURNS_VARIABLE, hopper.FWD_EXP2_FMA_VARIABLE
# the ring's depth before v17 (3 at D 64, 2 at D 128), and a row's value per head dim where it differs
RING = {64: "3", 128: "2"}
# every row sets every variable
UNSET = dict.fromkeys((BACKEND, *hopper.VARIABLES), "")
BEFORE = {**UNSET, FWD: "heads", OVERLAP: "0", STAGES: RING, PERSISTENT: "0", BWD_PERSISTENT: "0", EXP2_FMA: "0"}
# (group, label, environment); a group's first row is what its others are compared with; the
# backward's rows force the Hopper kernels (unset, shorter sequences than MIN_SEQ run Triton's)
VARIANTS = [("default", "before", BEFORE),
            ("default", "fwd_order=l2", {**BEFORE, FWD: "l2"}),
            ("default", "l2 + fwd_overlap=1", {**BEFORE, FWD: "l2", OVERLAP: "1"}),
            ("default", "l2 + fwd_stages=3", {**BEFORE, FWD: "l2", STAGES: "3"}),
            ("default", "l2 + overlap=1 + stages=3", {**BEFORE, FWD: "l2", OVERLAP: "1", STAGES: "3"}),
            ("persistent", "a program per tile", {**UNSET, PERSISTENT: "0", BWD_PERSISTENT: "0"}),
            ("persistent", "persistent forward", {**UNSET, PERSISTENT: "1", BWD_PERSISTENT: "0"}),
            ("persistent", "persistent both ways", {**UNSET, PERSISTENT: "1", BWD_PERSISTENT: "1"}),
            ("turns", "each consumer when ready", {**UNSET, TURNS: "0"}),
            ("turns", "the consumers in turn", {**UNSET, TURNS: "1"}),
            ("exp2", "every exp2 on the exp2 unit", {**UNSET, EXP2_FMA: "0"}),
            ("exp2", "a share on the FMA pipe", {**UNSET, EXP2_FMA: "1"}),
            ("backward", "bwd_by_keys=0 (by rows)", {**UNSET, BACKEND: "gluon", BY_KEYS: "0"}),
            ("backward", "by keys (the default)", {**UNSET, BACKEND: "gluon"}),
            ("backward", "triton (portable) both ways", {**UNSET, BACKEND: "triton"}),
            ("order", "shortest first", {**UNSET, BACKEND: "gluon", ORDER: "shortest"}),
            ("order", "longest first", {**UNSET, BACKEND: "gluon", ORDER: "longest"})]
GROUPS = list(dict.fromkeys(group for group, _, _ in VARIANTS))  # in order
BACKWARD_AT = tuple(hopper.BWD_BY_ROWS)  # elsewhere the backward has one form: its rows add nothing


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def peers(D: int, group: str, masks: dict) -> list:
    """(group, label, environment, fn) of the peers with these masks (doc_ids, window; cuDNN only
    without them): compared with that group's first row (the last group timed at D: the backward's
    at BACKWARD_AT)."""
    rows = [] if masks else [(group, "cudnn", {}, cudnn)]
    if (why := fa4_unsupported(D, torch.bfloat16, torch.device("cuda"))) is None:
        rows += [(group, "fa4", {}, lambda q, k, v: fa4_attention(q, k, v, **masks)),
                 (group, "fa4 deterministic", {}, lambda q, k, v: fa4_attention(q, k, v, **masks, deterministic=True))]
    else:
        print(f"FlashAttention-4 skipped: {why}")
    return rows


def ours(masks: dict):
    return lambda q, k, v: flash_attention(q, k, v, causal=True, **masks)


def shape(T: int, D: int, documents: bool, window: int) -> tuple[int, int, dict, float]:
    """(B, H, masks, forward FLOPs) of one cell: causal with B = 16384 // T (at least 1), or one
    sequence of T tokens under synthetic documents and a window, its FLOPs those of the pairs the
    mask leaves (masks empty where there is none)."""
    H = 1024 // D
    if not (documents or window):
        B = max(1, 16384 // T)
        return B, H, {}, attention_flops(B, H, T, T, D, causal=True)
    lengths = document_lengths("synthetic", T) if documents else [T]
    doc_ids = document_ids(lengths) if documents else None
    flops = sum(attention_flops(1, H, n, n, D, causal=True, window=window) for n in lengths)
    return 1, H, {"doc_ids": doc_ids, "window": window}, flops


def measure(fn, qkv: torch.Tensor, dout: torch.Tensor):
    """(fwd ms, fwd+bwd ms, (o, dq, dk, dv)) of fn on the (B, H, T, D) views of qkv (B, T, 3, H, D)."""
    views = lambda: [x.transpose(1, 2) for x in qkv.unbind(2)]
    q, k, v = views()
    o = fn(q, k, v)
    outputs = (o, *torch.autograd.grad(o, (q, k, v), dout))
    fwd = do_bench(lambda: fn(*views()), warmup=5, rep=25, return_mode="median")
    fwd_bwd = do_bench(lambda: fn(*views()).backward(dout), warmup=5, rep=25, grad_to_none=[qkv],
                       return_mode="median")
    return fwd, fwd_bwd, outputs


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=positive_ints, default=[64, 128], help="comma list of 64, 128")
    p.add_argument("--seq-lens", type=positive_ints, help="comma list (default 2048,4096,8192,16384; 32768 "
                   "with --documents or --window)")
    p.add_argument("--documents", action="store_true", help="B = 1, the mask within synthetic documents of "
                   "256-4096 tokens")
    p.add_argument("--window", type=positive_int, default=0, help="B = 1, each query sees its last WINDOW keys")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help=f"comma list of the groups to time: {', '.join(GROUPS)}")
    args = p.parse_args(argv)
    if bad := [D for D in args.head_dims if D not in hopper.HEAD_DIMS]:
        p.error(f"--head-dims {bad[0]}: the Hopper kernels take {', '.join(map(str, hopper.HEAD_DIMS))}")
    groups = [g.strip() for g in args.groups.split(",")]
    if bad := sorted(set(groups) - set(GROUPS)):
        p.error(f"--groups {bad[0]}: use {', '.join(GROUPS[:-1])} or {GROUPS[-1]}")
    seq_lens = args.seq_lens or ([32768] if args.documents or args.window else [2048, 4096, 8192, 16384])
    require_cuda("bench_variants.py")
    print(environment())
    if args.documents or args.window:
        print(f"one sequence a cell (B = 1){', within synthetic documents' if args.documents else ''}"
              f"{f', a window of {args.window} keys' if args.window else ''}; TFLOP/s of the pairs the mask leaves")
    print(f"{'D':>4} {'T':>6} {'variant':<28} {'fwd TF/s':>9} {'x':>6} {'f+b TF/s':>9} {'x':>6}  max|diff| o dq dk dv")
    for D in args.head_dims:
        rows = [(g, label, env) for g, label, env in VARIANTS
                if g in groups and (g != "backward" or D in BACKWARD_AT)]
        if not rows:
            print(f"D = {D}: the backward has one form at this head dim; no rows of {', '.join(groups)}")
            continue
        for T in seq_lens:
            B, H, masks, flops = shape(T, D, args.documents, args.window)
            torch.manual_seed(0)
            qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            firsts = {}
            for group, label, env, fn in [(*row, ours(masks)) for row in rows] + peers(D, rows[-1][0], masks):
                with environ({key: v[D] if isinstance(v, dict) else v for key, v in env.items()}):
                    fwd, fwd_bwd, outputs = measure(fn, qkv, dout)
                first = firsts.setdefault(group, (fwd, fwd_bwd, outputs))
                diffs = " ".join(f"{(a.float() - b.float()).abs().max().item():.1e}" for a, b in zip(outputs, first[2]))
                print(f"{D:>4} {T:>6} {label:<28} {flops / fwd * 1e-9:>9.1f} {first[0] / fwd:>6.3f} "
                      f"{3.5 * flops / fwd_bwd * 1e-9:>9.1f} {first[1] / fwd_bwd:>6.3f}  {diffs}", flush=True)
            del qkv, dout, firsts, first, outputs, masks, fn  # the last row's gradients and mask too
            torch.cuda.empty_cache()


if __name__ == "__main__":
    with stoppable("bench_variants.py", lambda: "the rows above are what was measured"):
        main()
