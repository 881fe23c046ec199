"""Benchmark decoding: the FlashDecoding kernel against SDPA on the same KV cache, and generation's
tokens/s with the cache against recomputing every window.

Part 1, the kernel: one new query row per head (GPT-2 small's 12 heads of 64, bf16; --kv-heads for
GQA) against caches of --cache-lens positions, batch --batches: ours (kernels/decode.py) and SDPA's
flash, efficient and cuDNN kernels on the cache's filled slice, each pinned; GPU time per call,
replayed from a CUDA graph (as generation runs it: launch overhead is not the kernels'), and the
cache's bytes read per microsecond.

Part 2, generation: GPT-2 small (random weights, in bf16, max_seq_len --context) extends a
prompt of context - new tokens by --new tokens, at each batch size: recomputing the window per
token (kv_cache=False), the cache in eager PyTorch, and the cache through a CUDA graph per token
(GPT.generate's default). Decode tokens/s is per token after the first: the prompt's forward and
the graph's capture, paid once per run, are timed apart.

    python scripts/bench_decode.py
    python scripts/bench_decode.py --cache-lens 8192,131072 --batches 1,16 --context 8192 --new 64
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from configs.schema import ModelConfig  # noqa: E402
from kernels.decode import decode_attention  # noqa: E402
from model import GPT  # noqa: E402
from scripts.args import ArgumentParser, positive_int, positive_ints, require_cuda  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402
from scripts.bench_attention import environment  # noqa: E402

SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-lens", type=positive_ints, default=[8192, 131072], help="comma list of cached positions")
    p.add_argument("--batches", type=positive_ints, default=[1, 16], help="comma list of batch sizes")
    p.add_argument("--kv-heads", type=positive_int, default=12, help="key/value heads of the 12 (GQA below 12)")
    p.add_argument("--context", type=positive_int, default=8192, help="generation: max_seq_len, prompt + new tokens")
    p.add_argument("--new", type=positive_int, default=64, help="generation: tokens generated per run")
    args = p.parse_args(argv)
    if 12 % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads}: must divide the 12 query heads")
    if args.new >= args.context:
        p.error(f"--new {args.new}: must be below --context {args.context} (the prompt fills the rest)")
    if args.new < 16:  # --new 8 read -2,322 tok/s on the H100: the graph's capture swamps a 4-token difference
        p.error(f"--new {args.new}: must be at least 16 (the decode rate is the difference between --new and "
                "--new / 2 tokens; fewer leave it to noise)")
    return args


def kernel_table(args) -> str:
    rows = ["| batch | cache | ours | " + " | ".join(SDPA) + " | ours, GB/s | ours / best SDPA |", "|---" * 8 + "|"]
    H, D = 12, 64
    for B in args.batches:
        for S in args.cache_lens:
            q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, args.kv_heads, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            length = torch.tensor([S], dtype=torch.int32, device="cuda")
            gqa = args.kv_heads != H
            calls = {"ours": lambda: decode_attention(q, k, v, length)}
            for name, backend in SDPA.items():
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                calls[name] = sdpa
            us = {}
            for name, call in calls.items():
                try:
                    call()  # compiles (ours) and checks the backend takes the shape
                    us[name] = do_bench_cudagraph(call, rep=50) * 1e3
                except RuntimeError as e:
                    us[name] = f"n/a ({str(e).splitlines()[0][:40]})"
            best = min((t for n, t in us.items() if n != "ours" and isinstance(t, float)), default=None)
            gbs = 2 * k.numel() * k.element_size() / us["ours"] / 1e3
            cells = [f"{t:.1f} us" if isinstance(t, float) else t for t in us.values()]
            ratio = f"{best / us['ours']:.2f}x" if best else "n/a"
            rows.append(f"| {B} | {S:,} | " + " | ".join(cells) + f" | {gbs:,.0f} | {ratio} |")
            print(rows[-1], flush=True)
            q = k = v = None  # freed before the next shape
            torch.cuda.empty_cache()
    return "\n".join(rows)


def _timed_generate(model, idx, new, **kw) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(idx, new, top_k=1, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def generation_table(args) -> str:
    cfg = ModelConfig(name="gpt2_small", max_seq_len=args.context,
                      n_kv_head=0 if args.kv_heads == 12 else args.kv_heads)
    model = GPT(cfg, "triton").cuda().to(torch.bfloat16).eval()  # inference weights: no cast per matmul
    rows = ["| batch | context | recompute, tok/s | cache eager, tok/s | cache + CUDA graph, tok/s "
            "| once per run (prompt, capture), ms: eager, graph | graph / recompute |", "|---" * 7 + "|"]
    for B in args.batches:
        prompt = torch.randint(0, 50257, (B, args.context - args.new), device="cuda")
        _timed_generate(model, prompt, 3)  # compiles and tunes every kernel of both paths
        _timed_generate(model, prompt, 3, kv_cache=False)
        steps = max(2, min(args.new, 16 if B == 1 else 4))  # the recompute path is slow: fewer tokens
        recompute = B * steps / _timed_generate(model, prompt, steps, kv_cache=False)
        # a decode token's cost: the difference between args.new tokens and half as many, which
        # leaves out what every run pays once (the prompt's forward, the graph's capture)
        half = args.new // 2
        rates, fixed = {}, {}
        for name, kw in (("eager", {"cuda_graph": False}), ("graph", {})):
            short, long = (_timed_generate(model, prompt, n, **kw) for n in (half, args.new))
            rates[name] = B * (args.new - half) / (long - short)
            fixed[name] = long - (args.new - 1) * (long - short) / (args.new - half)
        rows.append(f"| {B} | {args.context:,} | {recompute:,.0f} | {rates['eager']:,.0f} | {rates['graph']:,.0f} "
                    f"| {fixed['eager'] * 1e3:.0f}, {fixed['graph'] * 1e3:.0f} "
                    f"| {rates['graph'] / recompute:.1f}x |")
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return "\n".join(rows)


def main():
    args = parse_args()
    require_cuda("bench_decode.py")
    env = environment()
    print(env, flush=True)
    kernels = kernel_table(args)
    generation = generation_table(args)
    print(f"\n{env}\n\ndecode attention, one new row per head, 12 heads x 64, {args.kv_heads} kv heads, bf16: GPU time "
          f"per call (CUDA graph replay)\n\n{kernels}\n\ngeneration, GPT-2 small in bf16, greedy: decode "
          f"tokens/s over the batch (once-per-run costs apart)\n\n{generation}")


if __name__ == "__main__":
    with stoppable("bench_decode.py", lambda: "the rows above are what was measured"):
        main()
