"""One rank of the check that the ring's bf16 buffers cost no bits (tests/test_context_parallel.py
runs it under torchrun, gloo, on the CPU, where Triton's interpreter cannot run bf16 matmuls).

The ring runs twice over the reference kernels (kernels/reference/flash_ref.py) on the inputs'
values in bf16, every output rounded to bf16, so that both runs sum the same values: once on bf16
inputs, where kernels/ring_attention.py keeps a sum in bf16 wherever at most two terms meet, once
on the same values in fp32, where every sum is fp32. Rounded to bf16, the fp32 run must give the
bf16 run's dQ, dK, dV and LSE bit for bit, and its o within one bf16 rounding (the merge's fp32
arithmetic may round differently by operand dtype on the CPU). Writes whether each holds to
OUT/rank<r>.pt.
    torchrun --nproc_per_node=N tests/ring_bf16_worker.py OUT
"""

import sys

import torch
import torch.distributed as dist

import kernels.ring_attention as ring_attention
from kernels.reference.flash_ref import flash_attention_reference_backward, flash_attention_reference_forward
from tests.ring_worker import inputs
from trainer.parallel import ContextParallel


def forward(q, k, v, causal, softmax_scale, backend):
    """The reference on q, k, v's values in bf16 (they are bf16 values in both runs), o in q's dtype."""
    o, lse = flash_attention_reference_forward(*(t.to(torch.bfloat16) for t in (q, k, v)), causal, softmax_scale)
    return o.to(q.dtype), lse


def backward(do, q, k, v, o, lse, causal, softmax_scale, backend):
    grads = flash_attention_reference_backward(*(t.to(torch.bfloat16) for t in (q, k, v, o)), lse,
                                               do.to(torch.bfloat16), causal, softmax_scale)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    cp = ContextParallel.of(dist.group.WORLD)
    ring_attention.flash_attn_forward, ring_attention.flash_attn_backward = forward, backward
    whole = inputs(8 * cp.size, 2, 2, 16, torch.bfloat16)
    shards = [cp.shard(t.transpose(1, 2), dim=1).transpose(1, 2) for t in whole]
    runs = {dtype: ring_attention.ring_attn_forward(*(t.to(dtype) for t in shards[:3]), cp.group)
            for dtype in (torch.bfloat16, torch.float32)}
    o16, lse16 = runs[torch.bfloat16]  # both backwards read the bf16 run's o and LSE: the same terms
    for dtype in runs:
        q, k, v, do = (t.to(dtype) for t in shards)
        runs[dtype] = (*runs[dtype], *ring_attention.ring_attn_backward(do, q, k, v, o16.to(dtype), lse16, cp.group))
    low, high = runs[torch.bfloat16], runs[torch.float32]
    same = {name: torch.equal(a, b.to(a.dtype)) for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), low, high)}
    # o: within one bf16 rounding of the fp32 run's
    same["o"] = same["o"] or bool(((low[0].float() - high[0]).abs() <= high[0].abs() * 2 ** -8).all())
    torch.save(same, f"{out}/rank{cp.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
