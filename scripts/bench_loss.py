"""Benchmark the language-model head + cross-entropy: time and memory of forward+backward.

The GPT-2 head (d = 768, vocab 50304) on N tokens, bf16 matmuls: the full loss (materialised
logits, as model.loss=full does), ours (kernels/cross_entropy.py, model.loss=chunked), and, when
installed, Apple's Cut Cross-Entropy (`pip install cut-cross-entropy`; exact, filter_eps=None, and
its default gradient filter) and Liger's fused linear cross-entropy (`pip install liger-kernel`).
Each gets fp32 x (N, d) and W (V, d) that require gradients, as in the model (LayerNorm output,
fp32 parameters); the libraries take bf16 copies, ours and the full loss run under bf16 autocast.
Peak extra memory: beyond x, W and their gradients. Loss error: against the full loss in float64.

    python scripts/bench_loss.py                     # N = 8192, 16384, 65536
    python scripts/bench_loss.py --tokens 16384 --chunks 2048,4096,8192
"""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.cross_entropy import full_cross_entropy, linear_cross_entropy  # noqa: E402
from scripts.args import ArgumentParser, positive_ints, require_cuda  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402

D, V = 768, 50304


def _ours(chunk):
    def loss(x, w, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear_cross_entropy(x, w, y, chunk)
    return loss


def _full(x, w, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return full_cross_entropy(x @ w.T, y)


def _cce(filter_eps):
    from cut_cross_entropy import linear_cross_entropy as cce

    return lambda x, w, y: cce(x.bfloat16(), w.bfloat16(), y, filter_eps=filter_eps)


def _liger(x, w, y):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()(w.bfloat16(), x.bfloat16(), y)


def implementations(chunks):
    impls = {"full": _full, **{f"ours_chunk{c}": _ours(c) for c in chunks}}
    try:
        import cut_cross_entropy  # noqa: F401
        impls |= {"cce_exact": _cce(None), "cce_filtered": _cce("high")}
    except ImportError:
        print("cut-cross-entropy not installed: its rows are left out")
    try:
        import liger_kernel  # noqa: F401
        impls["liger_flce"] = _liger
    except ImportError:
        print("liger-kernel not installed: its row is left out")
    return impls


def bench(name, fn, x, w, y, reference):
    def fwd_bwd():
        fn(x, w, y).backward()

    try:
        fwd_bwd()  # compile / autotune outside the timed region
        ms = do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=[x, w], return_mode="median")
        x.grad = w.grad = None
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(x, w, y)
        loss.backward()
        torch.cuda.synchronize()
        grads = (x.numel() + w.numel()) * 4
        peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
        err = abs(loss.item() - reference)
    except torch.cuda.OutOfMemoryError:
        return f"| {name} | OOM | | | |"
    finally:
        x.grad = w.grad = None
        gc.collect()
        torch.cuda.empty_cache()
    return f"| {name} | {ms:.2f} | {x.shape[0] / ms / 1e3:,.0f} | {peak:,.0f} | {err:.1e} |"


def main():
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=positive_ints, default=[8192, 16384, 65536], help="comma list of N")
    p.add_argument("--chunks", type=positive_ints, default=[4096], help="comma list of our chunk sizes")
    args = p.parse_args()
    require_cuda("bench_loss.py")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | d = {D}, vocab = {V}, bf16 matmuls")
    impls = implementations(args.chunks)
    for N in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(N)
        x = torch.randn(N, D, device="cuda", generator=gen).requires_grad_()
        w = (0.02 * torch.randn(V, D, device="cuda", generator=gen)).requires_grad_()
        y = torch.randint(0, 50257, (N,), device="cuda", generator=gen)
        with torch.no_grad():
            reference = full_cross_entropy(x.double() @ w.double().T, y).item() if N <= 16384 else float("nan")
        print(f"\nN = {N} tokens: forward+backward\n\n| loss | ms | k tokens/s | peak extra MiB | |loss - float64| |"
              "\n|---|---|---|---|---|")
        for name, fn in impls.items():
            print(bench(name, fn, x, w, y, reference), flush=True)
        del x, w, y
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    with stoppable("bench_loss.py", lambda: "the rows above are what was measured"):
        main()
