"""The score modifications attention ablations make, in one home: what each does to a score before
the softmax, and its derivative, which is all the backward needs of it.

A modification is a function of the scaled score s = scale * q_i . k_j, its query row i, key j and
head h (the shape of FlexAttention's score_mod); the mask still decides which scores exist. In the
backward, the gradient of the softmax's input reaches the scaled score through the modification's
derivative:

    softcap C > 0 (Gemma 2):     s -> C tanh(s / C)             d/ds = 1 - tanh^2(s / C)
    ALiBi (Press et al., 2022):  s -> s - slope_h |j - i'|      d/ds = 1

with i' = i + S - T, the query's position among the keys (bottom-right, as the causal mask). Under
the causal mask |j - i'| = i' - j, the paper's bias; without it the distance to a later key counts
the same (FlashAttention's convention). Softcap runs first, then the bias: the cap bounds what q
and k say, not where they sit.

A sink (gpt-oss) changes the softmax, not a score: one learnable logit per head joins every row's
denominator and attends nothing, so a row may give part of its weight to no key. Its gradient is
-sum_i P_i,sink delta_i, from the LSE and delta = rowsum(dO * O) the backward already has
(docs/flash-attention.md section 10 derives it; kernels/reference/flash_steps.py: step_sinks checks it).
"""

import dataclasses
import functools
import math

import torch


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(n_heads,) float64: ALiBi's geometric slopes, 2^(-8/n) to the power h + 1 for a power of two
    n; otherwise the nearest lower power of two's slopes, then every other slope of twice that."""
    if n_heads < 1:
        raise ValueError(f"alibi_slopes: n_heads={n_heads}: need at least one head")

    def powers(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    below = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(below) + powers(2 * below)[0::2][:n_heads - below]
    return torch.tensor(slopes, dtype=torch.float64)


@functools.cache
def kernel_slopes(n_heads: int, device: torch.device) -> torch.Tensor:
    """(n_heads,) float32 on device: alibi_slopes times log2(e), the bias per key of distance in the
    kernels' base-2 softmax; made once per head count and device."""
    return (alibi_slopes(n_heads) * math.log2(math.e)).to(device=device, dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """The score modifications of one attention: softcap C (0: none), ALiBi (per-head slopes)."""
    softcap: float = 0.0
    alibi: bool = False

    def __post_init__(self):
        cap = self.softcap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap >= 0 and math.isfinite(cap)):
            raise ValueError(f"softcap={cap}: a cap is a finite number > 0, or 0 for none")
        if not isinstance(self.alibi, bool):
            raise ValueError(f"alibi={self.alibi}: true or false")

    def __bool__(self) -> bool:
        return bool(self.softcap or self.alibi)

    def apply(self, s: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The modified scores of the scaled scores s (differentiable). bias: ALiBi's at s's
        positions; by default s is a whole (..., H, T, S) score matrix and the bias is made."""
        if self.softcap:
            s = self.softcap * torch.tanh(s / self.softcap)
        if self.alibi:
            if bias is None and s.dim() < 3:
                raise ValueError(f"ScoreMods.apply: scores {tuple(s.shape)}: ALiBi needs (..., H, T, S) or a bias")
            s = s + (self.alibi_bias(*s.shape[-3:], s.device) if bias is None else bias).to(s.dtype)
        return s

    @staticmethod
    def alibi_bias(H: int, T: int, S: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """(H, T, S) in dtype: ALiBi's -slope_h |j - i'|, i' = i + S - T the query's position."""
        i = torch.arange(T, device=device, dtype=dtype)[:, None] + (S - T)
        j = torch.arange(S, device=device, dtype=dtype)[None, :]
        return -alibi_slopes(H).to(device, dtype)[:, None, None] * (j - i).abs()

    def derivative(self, s: torch.Tensor) -> torch.Tensor | float:
        """d(apply)/ds at the unmodified scaled scores s: what dS is multiplied by on its way back."""
        return 1.0 - torch.tanh(s / self.softcap) ** 2 if self.softcap else 1.0
