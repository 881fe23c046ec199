"""The ring's own buffers, on the CPU: the peak memory of one ring-attention forward and backward
(kernels/ring_attention.py over gloo) beside one process's attention over as many tokens.

    torchrun --standalone --nproc_per_node=2 scripts/ring_memory.py
    torchrun --standalone --nproc_per_node=4 scripts/ring_memory.py --tokens 16384 --heads 12 --head-dim 64
    torchrun --standalone --nproc_per_node=2 scripts/ring_memory.py --head-groups 1,2,4

The kernels are replaced by stand-ins that only allocate what they return (o and LSE; dQ, dK and
dV), so the peak is the ring's plan alone: the K/V in hand and on their way, the output and the
sums, and the kernels' outputs while they are read. One process's attention holds o, then dQ, dK
and dV. Memory is the largest rise of the process's resident set over the call (Linux's VmHWM,
reset before it), with glibc's mmap threshold at 64 KiB, so that every tensor's pages come and go
with it; it is printed in units of q's bytes (--tokens x --heads x --head-dim bf16 values), the
same unit on a GPU, where each unit is the GPU memory of q at that length (the CPU also makes fp32
copies of bf16 operands for mixed-dtype ops, which CUDA does not: a GPU's peaks should be lower).
Each rank prints a line for each --head-groups (ring_attention's head_groups: the heads go round
in that many passes).
"""

import os
import sys
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # read by glibc at start: run again with it set
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kernels.ring_attention as ring_attention  # noqa: E402
from scripts.args import ArgumentParser, fail, positive_int, positive_ints  # noqa: E402


def forward(q, k, v, causal, softmax_scale, backend):
    return torch.zeros_like(q), torch.zeros(q.shape[:3])


def backward(do, q, k, v, o, lse, causal, softmax_scale, backend):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def peak_bytes(fn) -> int:
    """The largest rise of this process's resident set while fn runs."""
    def resident(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith(field)).split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = resident("VmRSS:")
    fn()
    return resident("VmHWM:") - base


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=16384, help="tokens a rank holds (even)")
    parser.add_argument("--heads", type=positive_int, default=12)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--head-groups", type=positive_ints, default=[1], help="comma-separated divisors of --heads")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        fail("ring_memory.py runs under torchrun: torchrun --standalone --nproc_per_node=N scripts/ring_memory.py")
    if args.tokens % 2:
        fail(f"--tokens {args.tokens}: must be even (a rank holds two zigzag chunks)")
    if any(args.heads % g for g in args.head_groups):
        fail(f"--head-groups {','.join(map(str, args.head_groups))}: each must divide --heads {args.heads}")
    dist.init_process_group("gloo")
    ring_attention.flash_attn_forward, ring_attention.flash_attn_backward = forward, backward
    # (B, H, T, D) views of (B, T, H, D) memory, as the model passes them
    q, k, v, do = (torch.randn(1, args.tokens, args.heads, args.head_dim).to(torch.bfloat16).transpose(1, 2)
                   for _ in range(4))
    unit = q.numel() * q.element_size()
    ring = ring_attention._Ring(dist.group.WORLD)
    scale = args.head_dim ** -0.5
    o, lse = ring_attention._forward(q, k, v, scale, ring, "auto")
    one = (peak_bytes(lambda: forward(q, k, v, True, scale, "auto")),
           peak_bytes(lambda: backward(do, q, k, v, o, lse, True, scale, "auto")))
    for groups in args.head_groups:
        ring_pass = (peak_bytes(lambda: ring_attention._forward(q, k, v, scale, ring, "auto", groups)),
                     peak_bytes(lambda: ring_attention._backward(do, q, k, v, o, lse, scale, ring, "auto", groups)))
        said = "; ".join(f"{name} {f / unit:.1f} / {b / unit:.1f}" for name, (f, b) in (("one process", one),
                                                                                       ("ring", ring_pass)))
        # one write a line: the ranks share stdout
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}, {args.tokens} tokens, head groups {groups}: peak "
              f"forward / backward, in units of q ({unit / 2**20:.1f} MiB): {said}\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
