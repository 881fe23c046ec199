"""Generates text from a training checkpoint.

    python scripts/sample.py ckpt=outputs/2026-11-22/07-00-00_sdpa_T128 prompt="JULIET:" max_new_tokens=300
"""

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

from configs.runtime import autocast, resolve_device  # noqa: E402
from configs.schema import ModelConfig  # noqa: E402
from data import get_encoding  # noqa: E402
from data.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, load_weights  # noqa: E402
from model import GPT  # noqa: E402


def load_model(ckpt: str, attn: str | None, device: torch.device) -> GPT:
    path = checkpoint_path(hydra.utils.to_absolute_path(ckpt))
    state = load_checkpoint(path)
    trained = state["config"]
    model = GPT(OmegaConf.merge(OmegaConf.structured(ModelConfig), trained["model"]), attn or trained["attn"]["name"])
    load_weights(model, state["model"], path)
    return model.to(device).eval()


@hydra.main(version_base="1.3", config_path="../configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    try:
        device = resolve_device(cfg.device)
        model = load_model(cfg.ckpt, cfg.attn, device)
    except (ValueError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(cfg.prompt)] * cfg.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with autocast("auto", device):
        out = model.generate(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, generator=gen)
    for row in out.tolist():
        print(enc.decode(row), end="\n---------------\n")


if __name__ == "__main__":
    main()
