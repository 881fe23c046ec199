"""Where one causal bf16 attention forward+backward spends its GPU time: each kernel's time per
step, from torch.profiler, ours (what `attn=triton` runs) beside SDPA's cuDNN backend and, where it is
installed (`pip install flash-attn-4`, CUDA 13, sm_90 or sm_100), FlashAttention-4 as `attn=fa4` runs it.

bench_attention.py times the whole call; this splits it, so that a gap to cuDNN can be put on the
forward, the backward or the passes around them (the backward's preprocessing, dQ's conversion,
the gradient copies both pay). Shapes as bench_attention.py's: B·T = --tokens, H·D = --width,
q, k, v strided views of one (B, T, 3, H, D) tensor as the model makes them. Needs a CUDA GPU:

    python scripts/profile_attention.py --head-dims 64,128 --seq-lens 4096,8192,16384
"""

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside kernels/
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kernels import flash_attention  # noqa: E402
from model.attention import ATTENTIONS as TRAINED  # noqa: E402
from scripts.args import ArgumentParser, positive_int, positive_ints, require_cuda, require_divisors  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402
from scripts.bench_attention import fa4_skipped, make_inputs  # noqa: E402


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTIONS = {"ours": lambda q, k, v: flash_attention(q, k, v, causal=True), "cudnn": cudnn}


def kernel_us(attn, leaves, get_qkv, dout, steps: int) -> dict[str, float]:
    """GPU microseconds per forward+backward step of each kernel that ran (by name)."""
    def step():
        torch.autograd.grad(attn(*get_qkv()), leaves, dout)

    for _ in range(3):  # compile, autotune, warm up
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            times[event.key] += event.self_device_time_total / steps
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=positive_ints, default=[64, 128])
    p.add_argument("--seq-lens", type=positive_ints, default=[4096, 8192, 16384])
    p.add_argument("--tokens", type=positive_int, default=16384, help="B·T")
    p.add_argument("--width", type=positive_int, default=1024, help="H·D")
    p.add_argument("--steps", type=positive_int, default=20, help="profiled steps per shape")
    args = p.parse_args()
    require_divisors(p, "--head-dims", args.head_dims, args.width, "--width", "H·D")
    require_divisors(p, "--seq-lens", args.seq_lens, args.tokens, "--tokens", "B·T")
    require_cuda("profile_attention.py")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | us of GPU time per forward+backward step",
          flush=True)  # each row as it comes, not when the buffer fills
    attentions = ATTENTIONS if fa4_skipped(args.head_dims) else {**ATTENTIONS, "fa4": TRAINED["fa4"].fn}
    for D in args.head_dims:
        for T in args.seq_lens:
            B, H = args.tokens // T, args.width // D
            inputs = make_inputs(B, H, T, D, "btHd")  # q, k, v views of one (B, T, 3, H, D) tensor
            totals = {}
            for name, attn in attentions.items():
                times = kernel_us(attn, *inputs, args.steps)
                totals[name] = sum(times.values())
                print(f"\nD = {D}, T = {T} (B = {B}, H = {H}), {name}: {totals[name]:,.0f} us", flush=True)
                for kernel, us in times.items():
                    print(f"  {us:9,.0f}  {kernel[:100]}", flush=True)
            print(f"\nD = {D}, T = {T}: " + ", ".join(f"ours / {name} GPU time {totals['ours'] / totals[name]:.3f}"
                                                    for name in totals if name != "ours"), flush=True)


if __name__ == "__main__":
    with stoppable("profile_attention.py", lambda: "the shapes above are what was profiled"):
        main()
