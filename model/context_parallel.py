"""Context parallelism: one sequence split over the ranks of a process group, zigzag.

The T tokens of a window are cut into 2N chunks; rank r of the N keeps chunks r and 2N-1-r, so
every rank has the same causal attention work (kernels/ring_attention.py explains the ring and
why this layout balances it). Token ids, targets and positions are sharded here; the model keeps
each token's global position for RoPE or the learned table.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.ring_attention import ring_attention


@dataclass(frozen=True)
class ContextParallel:
    group: dist.ProcessGroup
    rank: int  # in the group
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "ContextParallel":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of x along dim (the sequence), in order: (..., T / N, ...)."""
        if x.size(dim) % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs a sequence length divisible by "
                             f"{2 * self.size} (two equal chunks per rank), got {x.size(dim)}")
        chunks = x.chunk(2 * self.size, dim)
        return torch.cat((chunks[self.rank], chunks[2 * self.size - 1 - self.rank]), dim)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(seq_len / N,) int64: the global positions of this rank's tokens."""
        return self.shard(torch.arange(seq_len, device=device), dim=0)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard (rank order): the inverse of ContextParallel.shard."""
    n = len(shards)
    halves = [h for s in shards for h in s.chunk(2, dim)]  # rank r's chunks r and 2n-1-r
    order = [halves[2 * r] for r in range(n)] + [halves[2 * r + 1] for r in reversed(range(n))]
    return torch.cat(order, dim)
