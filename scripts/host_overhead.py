"""Host (CPU) time vs GPU time of one eager flash_attention forward+backward, and where it goes.

When the host time per call exceeds the GPU time, the GPU waits on Python and short sequences
look slow in eager benchmarks (docs/perf-notes.md: the host's path). Host time here is wall time
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

--against-cudnn measures only where the Hopper kernels start, T = 2048 at D = 64 and 128 in the
training layout (q, k, v views of one (B, T, 3, H, D) tensor, B * T = 16384, H * D = 1024), ours
beside SDPA's cuDNN backend: host time per forward+backward, the GPU held busy by a spin kernel
(torch.cuda._sleep) so that the host never waits, min and median of 12 bursts of 40 calls; and
the GPU's time per forward+backward alone, the call captured in a CUDA graph and replayed (both
sides' include the backward of the q, k, v views, one copy kernel). Where the host's time passes
the GPU's, an eager benchmark reads the host (docs/perf-notes.md).
Needs a CUDA GPU:

    python scripts/host_overhead.py
    python scripts/host_overhead.py --against-cudnn
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside kernels/
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import backends, flash_attention, flash_attn_backward, flash_attn_forward  # noqa: E402
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


def burst_us(fn, calls: int = 40, bursts: int = 12) -> tuple[float, float]:
    """(min, median) host us per call over bursts of `calls` calls, each burst queued behind a spin
    kernel longer than it, so that the host never waits on the GPU."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(bursts):
        torch.cuda._sleep(150_000_000)  # ~80 ms at the H100's clock: longer than a burst's host time
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return min(per_call), statistics.median(per_call)


def graphed_us(fn) -> float:
    """GPU us per call of fn (autograd's backward included), captured in a CUDA graph and replayed:
    the host is out of the loop."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def against_cudnn() -> None:
    """T = 2048, the training layout: host and GPU time of a forward+backward, ours and cuDNN's."""
    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    T = 2048
    for D in (64, 128):
        B, H = 16384 // T, 1024 // D
        qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        ran = backends.backends(D, torch.bfloat16, qkv.device, T)  # Gluon on an H100; Triton's elsewhere
        print(f"D={D} T={T} B={B} H={H}, forward+backward, us per call (ours: {ran['forward']} forward, "
              f"{ran['backward']} backward):")
        for name, attend in (("ours", flash_attention), ("cuDNN", cudnn)):
            def step():
                qkv.grad = None  # as a benchmark's grad_to_none: no accumulation
                attend(*(x.transpose(1, 2) for x in qkv.unbind(2))).backward(do)

            def captured():
                torch.autograd.grad(attend(*(x.transpose(1, 2) for x in qkv.unbind(2))), qkv, do)
            low, median = burst_us(step)
            print(f"  {name:5s} host {low:6.0f} (min) {median:6.0f} (median); GPU {graphed_us(captured):6.0f}")


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against-cudnn", action="store_true",
                        help="only T = 2048 in the training layout, ours beside cuDNN: host and GPU time")
    args = parser.parse_args()
    require_cuda("host_overhead.py")
    if args.against_cudnn:
        against_cudnn()
        return
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
            out, lse_ = torch.ops.kernels.flash_attn_fwd(q, k, v, True, D**-0.5, None, None, "auto")
            torch.ops.kernels.flash_attn_bwd(do, q, k, v, out, lse_, True, D**-0.5, None, None, "auto")

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
