"""The model's typed config: plain dataclasses, so the model needs no Hydra or OmegaConf
(configs/schema.py registers them for the command line)."""

from dataclasses import dataclass, field
from enum import StrEnum

# OmegaConf's marker of a value the config must set (its omegaconf.MISSING), spelled out so that
# `import model` imports no config library: a composed config without model.name fails
MISSING = "???"


class PosEmb(StrEnum):
    learned = "learned"
    rope = "rope"


class Loss(StrEnum):
    chunked = "chunked"  # linear + cross-entropy a chunk of tokens at a time (kernels/cross_entropy.py)
    full = "full"  # the (tokens x vocab) logits, then cross-entropy


class Checkpointing(StrEnum):
    none = "none"
    selective = "selective"  # keep what the attention op returned (output and LSE), recompute the rest of each block
    full = "full"  # recompute each block in the backward
    offload = "offload"  # full, with each block's input kept in CPU memory until its backward (model/offload.py)


@dataclass
class ModelConfig:
    name: str = MISSING
    n_layer: int = 12
    n_head: int = 12
    # key/value heads, dividing n_head: each serves n_head / n_kv_head query heads (GQA; 1: MQA);
    # 0: n_head, plain multi-head attention
    n_kv_head: int = 0
    d_model: int = 768
    # learned position table size; seq_len may not exceed it (RoPE has no table but keeps the cap)
    max_seq_len: int = 1024
    vocab_size: int = 50257  # GPT-2 BPE; the model pads it to a multiple of 64
    pos_emb: PosEmb = PosEmb.learned
    rope_theta: float = 10000.0
    dropout: float = 0.0
    bias: bool = False
    loss: Loss = Loss.chunked
    loss_chunk: int = 4096  # tokens per chunk of the chunked loss
    mlp_chunk: int = 0  # tokens per chunk of a sequence-tiled MLP (model/gpt.py); 0: the whole sequence at once
    z_loss: float = 0.0  # weight of lse^2 in the loss (PaLM's z-loss); 0 disables
    # each layer's sliding window, the list repeating over the layers (0: global; e.g. [1024,1024,1024,0],
    # three local layers to a global one); empty: every layer takes attn.window
    window_pattern: list[int] = field(default_factory=list)
