"""Typed config schemas: every key's type and, for choices, the values it may take.

Hydra validates every YAML file and command-line override against these dataclasses
(configs/store.py registers them): an undeclared key (`model.n_layers=4`), a value of the wrong
type (`seq_len=long`) or a choice outside its enum (`model.pos_emb=alibi`) fails at compose time,
naming the key and what is allowed. The model's and the data's own schemas live beside the code
that reads them (model/config.py, data/config.py); the attention choices are the registry's
(model/attention.py). Checks that need several keys or the machine live in configs/validate.py.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from data.config import DataConfig, DataSource
from kernels.backends import BACKENDS
from model.attention import ATTENTIONS
from model.config import Checkpointing, Loss, ModelConfig, PosEmb

__all__ = ["AttnConfig", "AttnName", "Checkpointing", "CompileMode", "CpRotate", "DataConfig", "DataParallel",
           "DataSource", "Dtype", "Loss", "ModelConfig", "OptimConfig", "ParallelConfig", "ParamDtype", "PosEmb",
           "KernelBackend", "SdpaBackend", "TrainConfig", "WandbConfig", "WandbMode", "plain"]

AttnName = StrEnum("AttnName", {name: name for name in ATTENTIONS})  # attn=: one per registered attention
KernelBackend = StrEnum("KernelBackend", {name: name for name in BACKENDS})  # attn.backend=: which of our kernels


class SdpaBackend(StrEnum):
    flash = "flash"
    cudnn = "cudnn"
    efficient = "efficient"
    math = "math"


class Dtype(StrEnum):
    auto = "auto"  # bf16 autocast on CUDA from compute capability 8.0, fp16 below, fp32 on the CPU
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"  # autocast with dynamic loss scaling: for GPUs without bf16 (T4, V100)


# torch.compile's mode, with compile=true; reduce-overhead replays each compiled graph as a CUDA
# graph, one launch for all its kernels (no host time per kernel)
CompileMode = StrEnum("CompileMode", {"default": "default", "reduce-overhead": "reduce-overhead"})


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class AttnConfig:
    name: AttnName = MISSING
    # pin SDPA to one backend; null lets torch choose (train.py logs which one ran)
    sdpa_backend: Optional[SdpaBackend] = None
    # attn=triton's kernels: auto (by length, the faster here), triton (the portable ones), gluon
    # (the Hopper ones, sm_90 only)
    backend: KernelBackend = KernelBackend.auto
    # sliding-window causal attention: each query sees its last `window` keys, itself included
    # (within its document with data.doc_mask); 0: every earlier key. model.window_pattern sets
    # one per layer instead
    window: int = 0
    # the windows grow in eighths over this many first steps (model/gpt.py: warmed_window); 0: whole from step 0
    window_warmup: int = 0
    # the ablations' modifications (kernels/score_mods.py; model/attention.py says which attention
    # computes which). softcap C: each scaled score s becomes C tanh(s / C) (Gemma 2); 0: none
    softcap: float = 0.0
    alibi: bool = False  # ALiBi: each head's slope times -(distance to the key) added to its scores
    sinks: bool = False  # one learnable logit per head and layer in every row's softmax, of no key
    # prefix-LM: every query sees the first `prefix` tokens of its sequence (of its document, with
    # data.doc_mask), later ones too; the loss counts only targets the prefix does not show
    prefix: int = 0


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


class ParamDtype(StrEnum):
    float32 = "float32"  # as stored: twice the bytes, each weight cast per use
    auto = "auto"  # on CUDA the autocast dtype (bf16): what every matmul casts its weights to anyway


class CpRotate(StrEnum):  # torch's ring (attn=sdpa): how each rank gets the others' K/V shards
    allgather = "allgather"  # all at once (one collective, under the first block; memory for all)
    alltoall = "alltoall"  # one shard along the ring per step, each under a block


@dataclass
class ParallelConfig:  # under torchrun: processes = data-parallel ranks x cp
    # context parallelism: split each sequence over this many ranks (ring attention: attn=triton
    # ours, attn=sdpa torch's)
    cp: int = 1
    dp: DataParallel = DataParallel.ddp  # how every process keeps the weights (with cp > 1 too)
    # dp=fsdp: the dtype each unit's weights are gathered in (shards and checkpoints stay fp32);
    # auto, the autocast dtype: half the bytes, and faster and smaller than float32 on 2 GPUs
    # (docs/several-gpus.md); only the LayerNorm gains differ from DDP's, used rounded
    param_dtype: ParamDtype = ParamDtype.auto
    # dp=fsdp: free each unit's gathered weights after its forward and gather them again for its
    # backward; false keeps them (one all-gather per step, the memory of the whole gathered model).
    # The last unit keeps them either way: with one unit (gpt2_small's default) it changes nothing
    reshard_after_forward: bool = True
    # dp=fsdp: consecutive blocks are gathered, resharded and reduced together in units of at least
    # this many parameters (1: a unit per block): each unit costs the host time of its hooks every
    # step, which a small model's blocks do not cover (docs/several-gpus.md)
    unit_params: int = 100_000_000
    cp_rotate: Optional[CpRotate] = None  # attn=sdpa with cp > 1; null: torch's default, allgather
    # attn=triton with cp > 1: the heads go round the ring in this many groups, one after the other
    # (a divisor of the K/V heads): the ring's buffers shrink as many times, for smaller transfers
    # and kernels; the same results, up to fp32 rounding (docs/several-gpus.md)
    cp_head_groups: int = 1


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
    compile_mode: CompileMode = CompileMode.default
    ac: Checkpointing = Checkpointing.none  # activation checkpointing per transformer block
    # a torch.profiler trace of steps 3-5 (and on CUDA a memory snapshot) in <run dir>/profile/
    profile: bool = False
    # path to a checkpoint (.pt) or to a run dir holding ckpt.pt; continues that run
    resume: Optional[str] = None
    sample_tokens: int = 120  # tokens generated after training (0 disables)
    sample_prompt: str = "ROMEO:"


def plain(cfg: DictConfig) -> dict:
    """cfg as plain Python values (choices as strings): for checkpoints, W&B and JSON."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
