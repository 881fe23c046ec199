"""One rank of the ring-attention check (tests/test_context_parallel.py runs it under torchrun).

Every rank draws the same whole-sequence q, k, v and dO (inputs()), runs ring attention on its
zigzag shard, given as strided (B, T, H, D)-memory views as the model passes them, and saves its
shard's o, lse, dq, dk, dv from the direct calls, with the heads in H_KV groups (q then
(B, H, T, D)-contiguous, as RoPE returns it) and through autograd, whether a second backward was
bit-identical, and whether every o came out in (B, T, H, D) memory, to OUT/rank<r>.pt. On the
CPU: gloo, fp32, Triton's interpreter; with DEVICE=cuda: NCCL, one GPU per rank, bf16.
    torchrun --nproc_per_node=N tests/ring_worker.py OUT T H H_KV D [DEVICE]
"""

import os

import sys

import torch
import torch.distributed as dist

from kernels.ring_attention import ring_attention, ring_attn_backward, ring_attn_forward
from trainer.parallel import ContextParallel


def inputs(T: int, H: int, H_kv: int, D: int, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of the whole sequence on the CPU, (B, H, T, D) views of (B, T, H, D) memory."""
    gen = torch.Generator().manual_seed(T * 1000 + H * 100 + H_kv * 10 + D)
    shapes = ((2, T, H, D), (2, T, H_kv, D), (2, T, H_kv, D), (2, T, H, D))
    return tuple(torch.randn(shape, generator=gen).to(dtype).transpose(1, 2) for shape in shapes)


def main(out: str, T: int, H: int, H_kv: int, D: int, device: str = "cpu") -> None:
    if device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device != "cpu" else "gloo")
    cp = ContextParallel.of(dist.group.WORLD)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # shard along T in (B, T, H, D) memory: the shards stay strided views, like the model's q, k, v
    q, k, v, do = (cp.shard(t.transpose(1, 2).to(device), dim=1).transpose(1, 2) for t in inputs(T, H, H_kv, D, dtype))
    q_rope = q.contiguous()  # (B, H, T, D) memory, as RoPE returns q (model/gpt.py): the grouped calls take it
    o, lse = ring_attn_forward(q, k, v, cp.group)
    dq, dk, dv = ring_attn_backward(do, q, k, v, o, lse, cp.group)
    again = ring_attn_backward(do, q, k, v, o, lse, cp.group)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o_autograd = ring_attention(*leaves, cp.group)
    o_autograd.backward(do)
    results = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "o_autograd": o_autograd.detach(),
               **{f"{n}_autograd": t.grad for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)}}
    # the heads in H_kv groups, one ring pass each (with one K/V head, the one group there is)
    o_grouped, lse_grouped = ring_attn_forward(q_rope, k, v, cp.group, head_groups=H_kv)
    results |= dict(zip(("o_grouped", "lse_grouped", "dq_grouped", "dk_grouped", "dv_grouped"),
                        (o_grouped, lse_grouped,
                         *ring_attn_backward(do, q_rope, k, v, o, lse, cp.group, head_groups=H_kv))))
    # whatever q's layout, o comes out in (B, T, H, D) memory: the model's transpose back is free
    results["bthd_layout"] = all(t.transpose(1, 2).is_contiguous() for t in (o, o_autograd, o_grouped))
    results = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in results.items()}
    results["deterministic"] = all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again, strict=True))
    torch.save(results, f"{out}/rank{cp.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:])
