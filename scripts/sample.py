"""Generates text from a training checkpoint.

    python scripts/sample.py ckpt=outputs/2026-11-22/07-00-00_sdpa_T128 prompt="JULIET:" max_new_tokens=300
"""

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

from configs.schema import ModelConfig  # noqa: E402
from data import get_encoding  # noqa: E402
from model import GPT  # noqa: E402


def load_model(ckpt_path: str, attn: str | None, device: torch.device) -> GPT:
    path = Path(hydra.utils.to_absolute_path(ckpt_path))
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.is_file():
        sys.exit(f"error: no checkpoint at {path}: pass ckpt=<run dir or .pt file> from a train.py run")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    trained = ckpt["config"]
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), trained["model"])
    model = GPT(model_cfg, attn or trained["attn"]["name"])
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


@hydra.main(version_base="1.3", config_path="../configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    model = load_model(cfg.ckpt, cfg.attn, device)
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(cfg.prompt)] * cfg.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        out = model.generate(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, generator=gen)
    for row in out.tolist():
        print(enc.decode(row), end="\n---------------\n")


if __name__ == "__main__":
    main()
