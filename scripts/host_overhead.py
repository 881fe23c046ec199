"""Host (CPU) time vs GPU time of one eager flash_attention forward+backward.

When the host time per call exceeds the GPU time, the GPU waits on Python and short sequences
look slow in eager benchmarks (docs/perf-notes.md, v2 and v3). Needs a CUDA GPU:

    python scripts/host_overhead.py
"""

import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside kernels/

from kernels import flash_attention, flash_attn_backward, flash_attn_forward  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_overhead needs a CUDA GPU")
    for D, T in ((64, 1024), (64, 8192)):
        B, H = 16384 // T, 1024 // D
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        o, lse = flash_attn_forward(q, k, v)
        fwd = do_bench(lambda: flash_attn_forward(q, k, v), return_mode="median")
        bwd = do_bench(lambda: flash_attn_backward(do, q, k, v, o, lse), return_mode="median")

        def step():
            flash_attention(q, k, v).backward(do)

        step()
        both = do_bench(step, grad_to_none=[q, k, v], return_mode="median")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        host = (time.perf_counter() - start) / 20 * 1e3  # launches queued, GPU not waited on
        torch.cuda.synchronize()
        print(f"D={D} T={T}: kernels fwd {fwd:.3f} + bwd {bwd:.3f} ms | eager fwd+bwd {both:.3f} ms "
              f"| host {host:.3f} ms per call")


if __name__ == "__main__":
    main()
