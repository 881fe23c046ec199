"""The attention swap point: one signature, and one registry of the implementations and what each can do.

Every implementation takes q (B, H, T, D), k and v (B, H_kv, T, D) with H_kv dividing H (grouped
key/value heads: query head h reads kv head h // (H / H_kv)), and optionally doc_ids (B, T) of packed
documents, a window W, a prefix P, score modifications and per-head sinks, and returns causal
attention shaped like q, in its dtype, within each document when doc_ids is given, over each
query's last W keys (its own included) when W > 0, with each document's first P keys seen by all
of it (a prefix-LM), its scores modified (kernels/score_mods.py: softcap, ALiBi) and a sink logit
per head in every row's softmax (sinks (H,)). The model calls the `fn` of the Attention it is
given and never asks which one it is. What an attention can do (head dims, the modifications,
splitting a sequence over ranks, what selective activation checkpointing keeps of it, how it
decodes against a KV cache) is written in its entry, once: the config's choices and checks, the
trainer, the benchmark and the equivalence check read it from here. A new attention is a
function and an entry below. How each decodes against the cache: model/kv_cache.py.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import MAX_HEAD_DIM, flash_attention, unsupported
from kernels.masking import Mask
from kernels.score_mods import ScoreMods
from model.kv_cache import DecodeFn, dense_decode, triton_decode
from model.peers import FA4_REFUSES, fa4_attention, fa4_unsupported, flex_attention, flex_unsupported

# (q, k, v, doc_ids=None, window=0, prefix=0, mods=None, sinks=None) -> (B, H, T, D)
AttentionFn = Callable[..., torch.Tensor]
# the ablations' modifications (attn.<name>): each attention computes them all but those it refuses
MODS = ("softcap", "alibi", "sinks", "prefix")


@dataclass(frozen=True)
class Modifications:
    """What every block's attention computes beyond its mask and window: the score modifications
    (attn.softcap, attn.alibi), a learnable sink logit per head (attn.sinks: a parameter of each
    block) and a prefix-LM's prefix of P keys (attn.prefix)."""
    scores: ScoreMods = ScoreMods()
    sinks: bool = False
    prefix: int = 0

    def __post_init__(self):
        if isinstance(self.prefix, bool) or not isinstance(self.prefix, int) or self.prefix < 0:
            raise ValueError(f"prefix={self.prefix}: a number of keys >= 0 (0: none)")

    @classmethod
    def of(cls, attn) -> "Modifications":
        """The modifications of a run's attn config (a mapping: attn.softcap, .alibi, .sinks, .prefix;
        absent keys are off, as in checkpoints written before they existed)."""
        return cls(ScoreMods(float(attn.get("softcap", 0.0)), bool(attn.get("alibi", False))),
                   bool(attn.get("sinks", False)), int(attn.get("prefix", 0)))

    def on(self) -> dict[str, object]:
        """The modifications that are on, by name (MODS), with their values."""
        values = {"softcap": self.scores.softcap, "alibi": self.scores.alibi, "sinks": self.sinks,
                  "prefix": self.prefix}
        return {name: value for name, value in values.items() if value}


@dataclass(frozen=True)
class Attention:
    name: str  # attn=<name>
    fn: AttentionFn
    about: str  # what runs, in a line
    # generation against a KV cache (model/kv_cache.py)
    decode: DecodeFn
    # graphable: decode reads no host copy of the cache's length, so a decode step may be captured
    # in a CUDA graph
    graphable: bool = False
    max_head_dim: int | None = None  # None: any
    # why (head_dim, dtype, device) cannot run, or None; None: anything runs
    unsupported: Callable[[int, torch.dtype, torch.device], str | None] | None = None
    # how one sequence splits over ranks (parallel.cp > 1): "ring", ours over its kernels
    # (kernels/ring_attention.py); "torch", torch's context_parallel (its ring over SDPA's CUDA
    # kernels, trainer/parallel.py); None: it cannot
    context_parallel: str | None = None
    # the ops selective activation checkpointing keeps (output and LSE); none: recomputed whole
    saved_ops: tuple = ()
    # which of our kernels run it (kernels/backends.py: auto, triton, gluon); None: it has no such choice
    backend: str | None = None
    # the modifications (MODS) it cannot compute, each with why; it computes the others
    refuses: dict = dataclasses.field(default_factory=dict)

    def refusal(self, name: str) -> str | None:
        """Why this attention cannot compute modification `name` (None: it can), and which can."""
        if name not in self.refuses:
            return None
        able = [a for a in ATTENTIONS if name not in ATTENTIONS[a].refuses]
        return (f"attn={self.name} cannot compute it ({self.refuses[name]}): use attn="
                f"{', '.join(able[:-1])} or {able[-1]}")


# -----------------------------------------------------------------------------
# the implementations


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                    window: int = 0, prefix: int = 0, mods: ScoreMods | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Textbook attention: materialises the (B, H, T, S) scores in the input dtype (S = T in training;
    the cache's length in decoding), in fp32 where they are modified. Fewer key/value heads (GQA)
    are repeated, each for its group of query heads. A sink is one more score per row, of no key."""
    if k.size(1) != q.size(1):  # query head h reads kv head h // (H / H_kv)
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, S)
    # softmax in (at least) fp32: bf16 exp/sum would lose the many small probabilities; the
    # modifications too: ALiBi's biases reach hundreds, where bf16 rounds by whole units
    fp32 = torch.promote_types(q.dtype, torch.float32)
    if mods:
        scores = mods.apply(scores.to(fp32))
    seen = Mask(q.size(-2), k.size(-2), True, doc_ids, window, prefix).dense(q.device)  # (B or 1, 1, T, S)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.to(fp32)[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.to(fp32), sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=fp32)
    return probs.to(q.dtype) @ v  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                   window: int = 0, prefix: int = 0, mods: ScoreMods | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch's fused attention; which backend runs is torch's choice unless pinned (configs/runtime.py).
    Where sdpa_masked says so it gets a dense (B or 1, 1, T, S) mask; with ALiBi or sinks a float
    bias (B or 1, H, T, S), which of torch's kernels only the memory-efficient one (and the math
    one) take and differentiate. A sink is a key of zeros whose score is its bias: q.0 = 0, and
    its value of zeros adds nothing to the output."""
    if mods and mods.softcap:
        raise ValueError(f"sdpa_attention: softcap={mods.softcap}: {SDPA_SOFTCAP}")
    gqa = k.size(1) != q.size(1)
    T, S = q.size(-2), k.size(-2)
    biased = bool(mods) or sinks is not None
    if not biased and not sdpa_masked(doc_ids is not None or prefix > 0, window, T, S):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = Mask(T, S, True, doc_ids, window, prefix).dense(q.device)
    if not biased:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if mods:  # ALiBi, the one modification that is a bias
        bias = bias + _alibi_bias(q.size(1), T, S, q.dtype, q.device)
    if sinks is not None:
        zero = k.new_zeros(*k.shape[:2], 1, k.size(-1))
        k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
        bias = bias.expand(bias.size(0), q.size(1), T, S)
        bias = torch.cat([bias, sinks.to(q.dtype)[None, :, None, None].expand(bias.size(0), -1, T, 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


@torch.compiler.disable
@functools.lru_cache(maxsize=4)
def _alibi_bias(H: int, T: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(H, T, S) ALiBi biases in dtype, made once per shape (in fp32: every layer of every step reads
    the same), not in each call."""
    return ScoreMods.alibi_bias(H, T, S, device, torch.float32).to(dtype)


SDPA_SOFTCAP = "SDPA takes a mask or a bias, not a function of each score"


def sdpa_masked(documents: bool, window: int, T: int, S: int) -> bool:
    """Whether sdpa_attention passes SDPA a dense mask (which its flash and cuDNN kernels do not take):
    with documents (or a prefix), a window shorter than the keys, or fewer queries than keys (SDPA's
    is_causal is aligned top-left, the newest queries' bottom-right)."""
    return documents or 0 < window < S or T != S


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                     window: int = 0, prefix: int = 0, mods: ScoreMods | None = None,
                     sinks: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Our FlashAttention kernels (kernels/triton/, and kernels/hopper/ on sm_90: backend chooses);
    with documents, a window or a prefix, block-sparse."""
    return flash_attention(q, k, v, causal=True, doc_ids=doc_ids, window=window, backend=backend, mods=mods,
                           sinks=sinks, prefix=prefix)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **masks_and_mods) -> torch.Tensor:
    """SDPA, or the naive attention where SDPA cannot (a softcap)."""
    mods = masks_and_mods.get("mods")
    attend = naive_attention if mods and mods.softcap else sdpa_attention
    return attend(q, k, v, **masks_and_mods)


# -----------------------------------------------------------------------------
# the registry


ATTENTIONS = {a.name: a for a in (
    Attention("naive", naive_attention, "textbook softmax attention, the (T x T) scores in memory",
              decode=functools.partial(dense_decode, attend=naive_attention)),
    Attention("sdpa", sdpa_attention, "torch.nn.functional.scaled_dot_product_attention (backend logged on CUDA)",
              decode=functools.partial(dense_decode, attend=sdpa_attention), context_parallel="torch",
              saved_ops=(torch.ops.aten._scaled_dot_product_flash_attention.default,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                         torch.ops.aten._scaled_dot_product_efficient_attention.default,
                         torch.ops.aten._scaled_dot_product_cudnn_attention.default),
              refuses={"softcap": SDPA_SOFTCAP}),
    Attention("triton", triton_attention, "our FlashAttention-2 forward and backward Triton kernels",
              max_head_dim=MAX_HEAD_DIM, unsupported=unsupported, context_parallel="ring",
              saved_ops=(torch.ops.kernels.flash_attn_fwd.default,), decode=triton_decode, graphable=True,
              backend="auto"),
    # the peers ours is measured against (model/peers.py); flex decodes through SDPA (naive for a
    # softcap), where a BlockMask and a compile per cache length would cost more than the step
    Attention("flex", flex_attention, "torch.nn.attention.flex_attention, compiled, with BlockMasks (CUDA to train)",
              decode=functools.partial(dense_decode, attend=dense_attention), unsupported=flex_unsupported),
    Attention("fa4", fa4_attention, "FlashAttention-4 (flash_attn.cute), optional: pip install flash-attn-4",
              decode=functools.partial(dense_decode, attend=fa4_attention), max_head_dim=256,
              unsupported=fa4_unsupported, refuses=FA4_REFUSES),
)}


def get_attention(name: str, backend: str = "auto") -> Attention:
    """The registry's entry of attn=name, its kernels' backend chosen where it has a choice (attn.backend)."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}: choose one of {sorted(ATTENTIONS)} (attn=NAME)")
    entry = ATTENTIONS[name]
    if backend == entry.backend or (backend == "auto" and entry.backend is None):
        return entry
    if entry.backend is None:
        raise ValueError(f"attn.backend={backend}: chooses which of our kernels attn=triton runs; attn={name} "
                         "has no such choice (attn.sdpa_backend pins SDPA's)")
    return dataclasses.replace(entry, fn=functools.partial(entry.fn, backend=backend), backend=backend)
