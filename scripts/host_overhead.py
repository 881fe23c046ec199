"""Host (CPU) time vs GPU time of one eager flash_attention forward+backward, and where it goes.

When the host time per call exceeds the GPU time, the GPU waits on Python and short sequences
look slow in eager benchmarks (docs/perf-notes.md, v2-v4 and v8). Host time here is wall time
per call over a burst of calls whose GPU work is queued, not waited on. Rows:

  forward / backward launches   flash_attn_forward / flash_attn_backward, no autograd
  ops forward+backward          the torch.library ops through the dispatcher, as torch.compile's
                                generated code calls them
  autograd, engine thread       flash_attention(...).backward(do): the backward runs on
                                autograd's CUDA device thread, as in training
  autograd, calling thread      the same with torch.autograd.set_multithreading_enabled(False)
  empty autograd.Function       forward and backward that launch nothing: autograd's own cost
  12 chained, per call          12 attentions in a row (each one's output the next one's q) and
                                one backward through all, as in a 12-layer model: the hand-over
                                to autograd's thread is paid once per backward, not per call;
                                the same for SDPA (the backend torch picks), C++ end to end

then a cProfile of the calling-thread variant (the engine thread is invisible to cProfile).
Needs a CUDA GPU:

    python scripts/host_overhead.py
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside kernels/

from kernels import flash_attention, flash_attn_backward, flash_attn_forward  # noqa: E402
from scripts.args import ArgumentParser, require_cuda  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.detach()  # a view: no kernel

    @staticmethod
    def backward(ctx, do):
        return do, None, None


def host_ms(fn, calls: int = 50) -> float:
    """Wall ms per call of `calls` back-to-back calls, the GPU synchronized only around the burst."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def main() -> None:
    # no options, but --help says what this does and a flag is refused
    ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_cuda("host_overhead.py")
    for D, T in ((64, 1024), (64, 8192)):
        B, H = 16384 // T, 1024 // D
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        o, lse = flash_attn_forward(q, k, v)
        gpu_fwd = do_bench(lambda: flash_attn_forward(q, k, v), return_mode="median")
        gpu_bwd = do_bench(lambda: flash_attn_backward(do, q, k, v, o, lse), return_mode="median")

        def step():
            flash_attention(q, k, v).backward(do)

        def empty_step():
            _Empty.apply(q, k, v).backward(do)

        def single_thread_step():
            with torch.autograd.set_multithreading_enabled(False):
                step()

        def ops():
            out, lse_ = torch.ops.kernels.flash_attn_fwd(q, k, v, True, D**-0.5, None, None)
            torch.ops.kernels.flash_attn_bwd(do, q, k, v, out, lse_, True, D**-0.5, None, None)

        def chained(attend, layers=12):
            def run():
                x = q
                for _ in range(layers):
                    x = attend(x, k, v)
                x.backward(do)
            return host_ms(run, calls=10) / layers

        def sdpa(q_, k_, v_):
            return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

        rows = {
            "forward launches": host_ms(lambda: flash_attn_forward(q, k, v)),
            "backward launches": host_ms(lambda: flash_attn_backward(do, q, k, v, o, lse)),
            "ops forward+backward": host_ms(ops),
            "autograd fwd+bwd, engine thread": host_ms(step),
            "autograd fwd+bwd, calling thread": host_ms(single_thread_step),
            "empty autograd.Function fwd+bwd": host_ms(empty_step),
            "12 chained, per call": chained(flash_attention),
            "12 chained, per call, SDPA": chained(sdpa),
        }
        print(f"\nD={D} T={T}: GPU time of the kernels: forward {gpu_fwd:.3f} ms, backward {gpu_bwd:.3f} ms")
        for name, ms in rows.items():
            print(f"  host {name:34s} {ms * 1e3:7.0f} us per call")
        if T == 1024:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(50):
                single_thread_step()
            profile.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    with stoppable("host_overhead.py", lambda: "the lines above are what was measured"):
        main()
