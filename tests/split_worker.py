"""One rank of the check of torch's context-parallel split (tests/test_context_parallel.py runs it
under torchrun, on gloo: the split shards on the CPU, though torch's ring runs SDPA's CUDA kernels only).

Every rank draws the same (2, T) token ids x and targets y, enters Parallel.split as attn=sdpa's
training step does, and saves what it got inside (its x, y and positions; whether SDPA was torch's
context-parallel one there) and after (whether SDPA was restored), and our ring's zigzag shard of
x, to OUT/rank<r>.pt.
    torchrun --nproc_per_node=N tests/split_worker.py OUT T
"""

import os
import sys

import torch
import torch.nn.functional as F

from trainer.parallel import Parallel


def main(out: str, T: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    par = Parallel.start(torch.device("cpu"), cp=world, cp_method="torch", cp_rotate="alltoall")
    x = torch.randint(50304, (2, T), generator=torch.Generator().manual_seed(T))
    y = torch.roll(x, -1, dims=1)
    sdpa = F.scaled_dot_product_attention
    with par.split(x.clone(), y.clone()) as (x_shard, y_shard, pos):
        results = {"x": x_shard.clone(), "y": y_shard.clone(), "pos": pos.clone(),
                   "patched": F.scaled_dot_product_attention is not sdpa}
    results.update(restored=F.scaled_dot_product_attention is sdpa, whole_x=x, whole_y=y, zigzag=par.cp.shard(x))
    torch.save(results, f"{out}/rank{par.cp.rank}.pt")
    par.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
