"""Times each Triton attention kernel under hand-picked block configs, one kernel at a time.

The autotuner picks among these at run time; this script shows the whole table, so a config
list can be chosen (and pruned) with numbers rather than guesses. Causal bf16, B*T = 16384,
H*D = 1024 as in scripts/bench_attention.py. Needs a CUDA GPU:

    python scripts/tune_attention.py --seq-lens 1024,8192 --head-dims 64,128
"""

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside kernels/
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from kernels import LAUNCHERS, MAX_HEAD_DIM, attention_flops, flash_attn_backward, flash_attn_forward  # noqa: E402
from scripts.args import ArgumentParser, names, positive_ints, require_cuda  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402

TOKENS, WIDTH = 16384, 1024  # B*T and H*D, as in scripts/bench_attention.py

# (resident rows, streamed rows, num_warps, num_stages); resident is BLOCK_M for the forward and
# dQ kernels, BLOCK_N for dK/dV
CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 8, 2)],
    "dkdv": [(128, 32, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
             (128, 64, 4, 2), (128, 16, 4, 4), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 4)],
    "dq": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3),
           (128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 4), (128, 32, 8, 4)],
}
RESIDENT = {"fwd": ("BLOCK_M", "BLOCK_N"), "dkdv": ("BLOCK_N", "BLOCK_M"), "dq": ("BLOCK_M", "BLOCK_N")}


def config(name: str, cand: tuple) -> triton.Config:
    (resident, streamed), (r, s, w, n) = RESIDENT[name], cand
    return triton.Config({resident: r, streamed: s}, num_warps=w, num_stages=n)


def time_pass(name, q, k, v, do) -> float:
    """Median ms of the pass that runs kernel `name`: the forward, or the whole backward."""
    if name == "fwd":
        return triton.testing.do_bench(lambda: flash_attn_forward(q, k, v), warmup=25, rep=100, return_mode="median")
    o, lse = flash_attn_forward(q, k, v)
    return triton.testing.do_bench(lambda: flash_attn_backward(do, q, k, v, o, lse), warmup=25, rep=100,
                                   return_mode="median")


def parse_args() -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=positive_ints, default=[1024, 8192], help=f"comma list of T dividing {TOKENS}")
    p.add_argument("--head-dims", type=positive_ints, default=[64, 128],
                   help=f"comma list of D dividing {WIDTH}, up to {MAX_HEAD_DIM}")
    p.add_argument("--kernels", type=names(CANDIDATES), default=list(CANDIDATES),
                   help=f"comma subset of {','.join(CANDIDATES)}")
    args = p.parse_args()
    bad_t = [T for T in args.seq_lens if TOKENS % T]
    if bad_t:
        p.error(f"argument --seq-lens: {bad_t} do not divide B·T = {TOKENS}: choose divisors of it")
    bad_d = [D for D in args.head_dims if WIDTH % D or D > MAX_HEAD_DIM]
    if bad_d:
        p.error(f"argument --head-dims: {bad_d}: each must divide H·D = {WIDTH} and be at most {MAX_HEAD_DIM}, "
                "the kernels' largest head dim")
    return args


def main() -> None:
    args = parse_args()
    require_cuda("tune_attention.py")
    best = {"fwd": CANDIDATES["fwd"][0], "dkdv": CANDIDATES["dkdv"][0], "dq": CANDIDATES["dq"][0]}
    rows = []
    for D in args.head_dims:
        for T in args.seq_lens:
            B, H = TOKENS // T, WIDTH // D
            gen = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            fwd_flops = attention_flops(B, H, T, T, D)
            for name in args.kernels:
                results = []
                with contextlib.ExitStack() as pins:  # the other kernels at the best found so far
                    for other, cand in best.items():
                        if other != name:
                            pins.enter_context(LAUNCHERS[other].pinned(config(other, cand)))
                    for cand in CANDIDATES[name]:
                        try:
                            with LAUNCHERS[name].pinned(config(name, cand)):
                                ms = time_pass(name, q, k, v, do)
                        except Exception as e:  # out of shared memory / registers: not a candidate
                            print(f"D={D} T={T} {name} {cand}: {type(e).__name__}")
                            continue
                        tflops = (fwd_flops if name == "fwd" else 2.5 * fwd_flops) / ms / 1e9
                        results.append((ms, cand))
                        print(f"D={D} T={T} {name:5s} {cand}: {ms:.3f} ms  {tflops:6.1f} TFLOP/s (pass)", flush=True)
                ms, cand = min(results)
                best[name] = cand
                rows.append((D, T, name, cand, ms))
    print("\n| D | T | kernel pass | best (resident, streamed, warps, stages) | ms |\n|---|---|---|---|---|")
    for D, T, name, cand, ms in rows:
        print(f"| {D} | {T} | {name} | {cand} | {ms:.3f} |")


if __name__ == "__main__":
    with stoppable("tune_attention.py", lambda: "the passes above are what was timed; no table of the best configs"):
        main()
