"""A small causal GPT: pre-LN blocks, learned or rotary positions, tied head, pluggable attention.

The attention comes in as an entry of model/attention.py's registry; this file calls its `fn` and
never knows which one runs, nor whether the sequence it sees is all of one or a context-parallel
rank's shard of it (the caller passes the tokens' positions then) or how documents are marked in
the tokens (the caller passes their ids).
"""

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels import attention_flops
from kernels.cross_entropy import IGNORE_INDEX, full_cross_entropy, linear_cross_entropy
from kernels.masking import Mask
from model.attention import Attention, AttentionFn, Modifications, get_attention
from model.config import ModelConfig
from model.kv_cache import DecodeFn, KVCache
from model.offload import Offload


def padded_vocab(vocab_size: int) -> int:
    # a multiple of 64 keeps the head matmul on full tensor-core tiles (50257 -> 50304)
    return (vocab_size + 63) // 64 * 64


class Rotary(nn.Module):
    """RoPE tables (positions x D/2); applied to q and k of shape (B, H, T, D)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        # angles in float64: in fp32, position 10^6 times a frequency near 1 is off by ~0.03 rad
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, D/2)
        # not persistent: derived from the config, so checkpoints stay small and shape-free
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """pos (T,): the tokens' positions in the sequence, if not 0..T-1 (a context-parallel shard)."""
        T = x.size(-2)
        cos, sin = (self.cos[:T], self.sin[:T]) if pos is None else (self.cos[pos], self.sin[pos])
        # rotate in fp32: bf16 angles at long positions lose the low-frequency pairs' precision
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()  # (B, H, T, D/2) each: consecutive pairs
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


class CacheStep(NamedTuple):
    """One forward of generation against a KV cache: the cache, and how many positions it holds
    once this forward's tokens are in (on the device, (1,) int32)."""
    cache: KVCache
    end: torch.Tensor


def layer_windows(pattern: list[int], window: int, n_layer: int) -> list[int]:
    """Each layer's window: model.window_pattern repeating over the layers, else attn.window for all."""
    return [pattern[i % len(pattern)] if pattern else window for i in range(n_layer)]


def warmed_window(window: int, step: int, warmup: int) -> int:
    """attn.window_warmup: a window grows in eighths over the first `warmup` steps, from window / 8
    at step 0 to the whole window from step 7/8 warmup on; global layers (0) stay global. Eighths,
    not every step's size, so that a compiled model or a kernel keyed by the window sees 8 of them."""
    if not window or step >= warmup:
        return window
    return max(1, window * min(8, 8 * step // warmup + 1) // 8)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn | None, rotary: Rotary | None, window: int = 0,
                 mods: Modifications = Modifications()):
        super().__init__()
        self.full_window = window  # each query's last `window` keys (0: all), once warmed up
        self.window = window  # this step's (GPT.warm_windows)
        self.mods, self.prefix = mods.scores, mods.prefix
        # one learnable logit per head in every row's softmax (attn.sinks); 0 at first: a sink
        # starts as one more key scoring 0
        self.sinks = nn.Parameter(torch.zeros(cfg.n_head)) if mods.sinks else None
        self.decode: DecodeFn | None = None  # set with attention (GPT.set_attention)
        self.layer = 0  # this block's index: its slot in a KV cache
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head or cfg.n_head
        # one projection: n_head query heads, then n_kv_head key and n_kv_head value heads
        self.qkv = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * (cfg.d_model // cfg.n_head),
                             bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual_scaled = True
        self.attention = attention
        self.rotary = rotary
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                cache: "CacheStep | None" = None) -> torch.Tensor:
        """x (B, T, C); pos (T,): the tokens' positions, if not 0..T-1; cache: this step of generation
        with a KV cache (the tokens' positions are then the cache's next ones)."""
        B, T, C = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        # (B, T, H + 2 H_kv, D) -> (B, H, T, D), (B, H_kv, T, D) x2 strided views; the kernels
        # take strides, no copy
        q, k, v = self.qkv(x).view(B, T, H + 2 * H_kv, C // H).split([H, H_kv, H_kv], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        # what is on, by keyword: an attention is called as it was before its options existed
        on = {"doc_ids": doc_ids, "window": self.window or None, "prefix": self.prefix or None,
              "mods": self.mods or None, "sinks": self.sinks}
        options = {key: value for key, value in on.items() if value is not None}
        if cache is None:
            y = self.attention(q, k, v, **options)  # (B, H, T, D)
        else:
            k_cache, v_cache = cache.cache.append(self.layer, k, v, pos)
            if cache.cache.filled == 0:  # prefill: the prompt alone, as in training
                y = self.attention(q, k, v, **options)
            else:  # decoded tokens attend causally: a prefix is what the prompt's prefill saw of it
                y = self.decode(q, k_cache, v_cache, cache.end, cache.cache.filled + T, self.window,
                                mods=self.mods or None, sinks=self.sinks)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual_scaled = True
        self.dropout = nn.Dropout(cfg.dropout)
        self.chunk = cfg.mlp_chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C). With model.mlp_chunk, the sequence goes through in chunks of that many tokens,
        each checkpointed: the (T, 4C) hidden activation never exists whole, only one chunk's, in the
        forward and again in the backward, at the price of running the chunk's forward twice."""
        if not self.chunk or x.size(1) <= self.chunk:
            return self._mlp(x)
        grad = torch.is_grad_enabled()
        return torch.cat([checkpoint(self._mlp, part, use_reentrant=False) if grad else self._mlp(part)
                          for part in x.split(self.chunk, dim=1)], dim=1)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn | None, rotary: Rotary | None, window: int = 0,
                 mods: Modifications = Modifications()):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, attention, rotary, window, mods)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                cache: "CacheStep | None" = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pos, doc_ids, cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: Attention | str, ac: str = "none", window: int = 0,
                 mods: Modifications = Modifications()):
        """attention: an entry of model/attention.py's registry, or its name; ac: activation
        checkpointing per block, none | selective | full | offload (model/config.py); window: each
        query sees its last `window` keys (attn.window; 0: all), in every layer unless
        cfg.window_pattern gives each its own; mods: the attention's modifications (attn.softcap,
        attn.alibi, attn.sinks, attn.prefix)."""
        super().__init__()
        self.cfg, self.ac = cfg, ac
        self.windows = layer_windows(list(cfg.window_pattern), window, cfg.n_layer)
        self.offload = Offload() if ac == "offload" else None
        self.vocab_size = padded_vocab(cfg.vocab_size)
        head_dim = cfg.d_model // cfg.n_head
        # one table shared by all layers
        rotary = Rotary(head_dim, cfg.max_seq_len, cfg.rope_theta) if cfg.pos_emb == "rope" else None
        self.tok_emb = nn.Embedding(self.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if rotary is None else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, None, rotary, w, mods) for w in self.windows)
        for i, block in enumerate(self.blocks):
            block.attn.layer = i
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: https://arxiv.org/abs/1608.05859
        self.apply(self._init_weights)
        self.set_attention(attention)

    def set_attention(self, attention: Attention | str) -> None:
        """The attention every block calls from now on (the weights do not depend on it): e.g. the
        plain kernels again, for generating whole sequences after training on context-parallel shards."""
        self.attention = get_attention(attention) if isinstance(attention, str) else attention
        for block in self.blocks:
            block.attn.attention, block.attn.decode = self.attention.fn, self.attention.decode

    def warm_windows(self, step: int, warmup: int) -> None:
        """Each layer's window at training step `step` of a warm-up of `warmup` steps (warmed_window)."""
        for block in self.blocks:
            block.attn.window = warmed_window(block.attn.full_window, step, warmup)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init; residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (GPT-2 paper, section 2.3)
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_scaled", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, matmul_only: bool = False) -> int:
        """Parameter count; matmul_only leaves out the position table (a lookup, no FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if matmul_only and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM's MFU convention): 6N for the weights, plus causal
        attention's QK^T and PV forward (kernels/flops.py; over each layer's window's pairs only,
        once warmed up: attn.window_warmup's first steps count more than they run) times 3 for
        forward and backward."""
        head_dim = self.cfg.d_model // self.cfg.n_head
        attention = sum(attention_flops(1, self.cfg.n_head, seq_len, seq_len, head_dim, True, window)
                        for window in self.windows) / seq_len
        return 6 * self.num_params(matmul_only=True) + 3 * attention

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache: KVCache | None = None):
        """idx (B, T) token ids -> (logits (B, T, V), None); with targets (B, T), (logits, mean loss),
        where model.loss=chunked returns no logits: it never makes them (kernels/cross_entropy.py).
        pos (T,): the tokens' positions in their sequence if not 0..T-1 (a context-parallel shard);
        doc_ids (B, T): attend within packed documents, each a run of equal ids. cache: generation's
        KV cache (model/kv_cache.py): idx are the tokens after those it holds, and join them."""
        B, T = idx.shape
        step = None
        if cache is not None:
            if cache.filled + T > min(self.cfg.max_seq_len, cache.max_len):
                raise ValueError(f"{cache.filled} cached + {T} new tokens exceed the cache's "
                                 f"{min(self.cfg.max_seq_len, cache.max_len)} positions")
            pos, step = cache.positions(T), CacheStep(cache, cache.length + T)
        if pos is None and T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds model.max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device) if pos is None else pos)
        x = self.drop(x)
        recompute = self.ac != "none" and self.training and torch.is_grad_enabled()
        if recompute and self.offload is not None:
            self.offload.new_forward()
        for block in self.blocks:
            if recompute:
                with self.offload.hooks() if self.offload is not None else contextlib.nullcontext():
                    x = checkpoint(block, x, pos, doc_ids, use_reentrant=False, context_fn=self._ac_context)
            else:
                x = block(x, pos, doc_ids, step)
        if cache is not None:
            cache.advance(T)
        x = self.ln_f(x)
        if targets is not None and self.blocks[0].attn.prefix > 1:
            targets = self._past_the_prefix(targets, doc_ids)
        if targets is not None and self.cfg.loss == "chunked":
            loss = linear_cross_entropy(x.view(B * T, -1), self.head.weight, targets.view(-1), self.cfg.loss_chunk,
                                        z_loss=self.cfg.z_loss)
            return None, loss
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, full_cross_entropy(logits.view(B * T, -1), targets.view(-1), z_loss=self.cfg.z_loss)

    def _past_the_prefix(self, targets: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """targets (B, T) without those a prefix shows its own queries: a prefix of P tokens sees the
        token after each of its first P - 1, so only from its last on does a token predict one it
        has not seen (a prefix-LM's loss is the rest's)."""
        B, T = targets.shape
        prefix = self.blocks[0].attn.prefix
        shown = Mask(T, T, True, doc_ids, prefix=prefix - 1).in_prefix(targets.device)  # (B or 1, T)
        return targets.masked_fill(shown, IGNORE_INDEX)

    def _ac_context(self):
        """Activation checkpointing of a block: full (and offload) recomputes it all in the backward;
        selective keeps what the attention's op returned (output and LSE; the registry's saved_ops)
        and recomputes the rest, the attention too where it is not one such op."""
        if self.ac != "selective":
            return contextlib.nullcontext(), contextlib.nullcontext()
        saved = self.attention.saved_ops
        return create_selective_checkpoint_contexts(
            lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE if op in saved
            else CheckpointPolicy.PREFER_RECOMPUTE)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 200,
                 generator: torch.Generator | None = None,
                 doc_ids_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 kv_cache: bool = True, cuda_graph: bool = True,
                 each_token: Callable[[], None] = lambda: None) -> torch.Tensor:
        """Extends idx (B, T) by max_new_tokens sampled tokens (top_k=1: greedy), calling each_token()
        after each (a progress bar's update; a check that raises to stop).

        kv_cache (model/kv_cache.py): the prompt's forward once, then one token's forward per new
        token, replayed from a CUDA graph where the attention reads the cache's length on the device
        (cuda_graph, on CUDA). Without it, and past model.max_seq_len tokens, and for a model that
        attends within documents (doc_ids_of: the document ids of a window), every token recomputes
        the forward of the last max_seq_len tokens."""
        B, T0 = idx.shape
        cache = graph = None
        if kv_cache and doc_ids_of is None and T0 < self.cfg.max_seq_len and max_new_tokens > 1:
            head_dim = self.cfg.d_model // self.cfg.n_head
            max_len = min(T0 + max_new_tokens - 1, self.cfg.max_seq_len)  # the last token needs no forward
            cache = KVCache(self.cfg.n_layer, B, self.cfg.n_kv_head or self.cfg.n_head, max_len, head_dim, idx.device)
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= cache.max_len:
                new = idx[:, cache.filled:]  # the prompt, then each sampled token
                if graph is not None:
                    logits = graph(new)
                else:
                    decoded = cache.filled > 0  # not the prompt's forward, which runs the training kernel
                    logits = self(new, cache=cache)[0][:, -1]
                    # an eager decode step has compiled and tuned its kernels (and cast the weights,
                    # under autocast): capture the next ones
                    graphable = cuda_graph and idx.is_cuda and self.attention.graphable
                    if graphable and decoded and cache.filled < cache.max_len:
                        graph = DecodeGraph(self, cache, B)
            else:
                window = idx[:, -self.cfg.max_seq_len:]
                logits = self(window, doc_ids=None if doc_ids_of is None else doc_ids_of(window))[0][:, -1]
            logits = logits[:, : self.cfg.vocab_size].float() / temperature  # drop padded ids
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
            each_token()
        return idx


class DecodeGraph:
    """One decode step (a token per row against the KV cache) captured in a CUDA graph: every later
    token replays the step's launches at once, where eager decoding pays Python per kernel. The
    graph reads its token from a fixed buffer and writes its logits to another; the cache's
    device-side length moves it along."""

    def __init__(self, model: GPT, cache: KVCache, batch: int):
        self.cache = cache
        self.idx = torch.zeros(batch, 1, dtype=torch.long, device=cache.length.device)
        self.graph = torch.cuda.CUDAGraph()
        # under autocast the eager decode step before this one left every weight's cast in autocast's
        # cache: the graph reads those, where a capture without the cache would re-cast every weight
        # on every token
        with torch.cuda.graph(self.graph):
            self.logits = model(self.idx, cache=cache)[0][:, -1]
        cache.filled -= 1  # capturing ran the step's Python (advance) but none of its kernels

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """The logits (B, V) after `token` (B, 1): valid until the next call."""
        self.idx.copy_(token)
        self.graph.replay()
        self.cache.filled += 1
        return self.logits
