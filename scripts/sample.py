"""Generates text from a training checkpoint.

    python scripts/sample.py ckpt=outputs/2026-11-22/07-00-00_sdpa_T128 prompt="JULIET:" max_new_tokens=300

configs/sample.yaml holds the keys and their defaults, SampleConfig their types. A bad key or value
is one line on stderr and exit code 2; sampling writes nothing.
"""

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: E402

from configs.overrides import quoted_where_needed  # noqa: E402
from configs.runtime import autocast, autocast_dtype, resolve_device  # noqa: E402
from configs.schema import AttnName, ModelConfig  # noqa: E402
from configs.validate import ConfigError  # noqa: E402
from data import TokenizerError, get_encoding  # noqa: E402
from trainer.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, load_weights  # noqa: E402
from trainer.shards import load_shards  # noqa: E402
from model import GPT, get_attention  # noqa: E402
from model.attention import Modifications  # noqa: E402
from scripts.args import fail, hydra_config  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402


@dataclass
class SampleConfig:  # the types of sample.yaml's keys; their values are there
    ckpt: str = MISSING
    prompt: str = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_k: Optional[int] = MISSING
    num_samples: int = MISSING
    seed: int = MISSING
    device: str = MISSING
    attention: Optional[AttnName] = MISSING
    kv_cache: bool = MISSING


def check(cfg: DictConfig) -> torch.device:
    """The device to sample on; ConfigError naming the first key whose value cannot run."""
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ConfigError("ckpt is not set: pass ckpt=<a run dir holding ckpt.pt, or a .pt file>")
    if not cfg.prompt:
        raise ConfigError("prompt='': must not be empty: the model continues it")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ConfigError(f"temperature={cfg.temperature}: must be a positive number")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ConfigError(f"top_k={cfg.top_k}: must be at least 1, or null for the whole vocabulary")
    for key, low in (("max_new_tokens", 0), ("num_samples", 1)):
        if cfg[key] < low:
            raise ConfigError(f"{key}={cfg[key]}: must be at least {low}")
    if not 0 <= cfg.seed < 2**64:
        raise ConfigError(f"seed={cfg.seed}: must be in [0, 2^64)")
    try:
        return resolve_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"device={cfg.device}: {e}") from None


def check_attention(attention: str | None, trained: str, head_dim: int, device: torch.device) -> None:
    """ConfigError where the attention to sample with (`attention`, else the `trained` one) cannot
    run here, as its entry in model/attention.py says (FlexAttention's refusal on the CPU is of its
    backward, which sampling does not run)."""
    name = attention or trained
    entry = get_attention(name)
    why = entry.unsupported and entry.unsupported(head_dim, autocast_dtype("auto", device) or torch.float32, device)
    if not why or (name == "flex" and device.type == "cpu"):
        return
    if attention:
        raise ConfigError(f"attention={name}: cannot run here: {why}; use attention=sdpa")
    raise ConfigError(f"attention=null: the checkpoint trained with attn={name}, which cannot run here: {why}; "
                      "pass attention=sdpa (the weights do not depend on it)")


def load_model(ckpt: str, attention: str | None, device: torch.device) -> GPT:
    path = checkpoint_path(hydra.utils.to_absolute_path(ckpt))
    state = load_checkpoint(path)
    trained = state["config"]
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), trained["model"])
    check_attention(attention, trained["attn"]["name"], model_cfg.d_model // model_cfg.n_head, device)
    mods = Modifications.of(trained["attn"])
    name = attention or trained["attn"]["name"]
    for key, value in mods.on().items():  # the weights were trained with them: an attention must compute them
        if why := get_attention(name).refusal(key):
            raise ConfigError(f"attention={name}: the checkpoint trained with attn.{key}={value}; {why}")
    if name == "flex" and mods.sinks and device.type == "cpu":
        raise ConfigError("attention=flex: the checkpoint trained with attn.sinks=True, which FlexAttention takes "
                          "through its log-sum-exp, which torch does not return on the CPU: use attention=naive or "
                          "sdpa")
    model = GPT(model_cfg, name, window=trained["attn"].get("window", 0), mods=mods)
    if state["shards"] is not None:  # a sharded run's: its shards, read whole into this one process
        load_shards(state["shards"]["path"], {"model": model.state_dict()})
    else:
        load_weights(model, state["model"], path)
    return model.to(device).eval()


@hydra.main(version_base="1.3", config_path="../configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    try:
        device = check(cfg)
        model = load_model(cfg.ckpt, cfg.attention, device)
        enc = get_encoding()
    except (ConfigError, TokenizerError) as e:
        fail(str(e))
    except CheckpointError as e:
        fail(f"ckpt={cfg.ckpt}: {e}")
    idx = torch.tensor([enc.encode_ordinary(cfg.prompt)] * cfg.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with autocast("auto", device):
        out = model.generate(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, generator=gen, kv_cache=cfg.kv_cache)
    for row in out.tolist():
        print(enc.decode(row), end="\n---------------\n")


if __name__ == "__main__":
    # here, not at import: importing this module changes no global state
    ConfigStore.instance().store(name="sample_schema", node=SampleConfig)
    sys.argv[1:] = quoted_where_needed(sys.argv[1:], SampleConfig)  # as typed: prompt='To be, or "not"'
    hydra_config(sys.argv[1:], "sample")  # a bad override in one line, not Hydra's block
    with stoppable("sample.py", lambda: "sampling writes nothing; a sample printed above is whole"):
        main()
