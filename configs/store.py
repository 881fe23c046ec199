"""Registers the schemas of configs/schema.py in Hydra's ConfigStore, where the YAML files find them,
and one `attn` option per attention of model/attention.py's registry (attn=naive|sdpa|triton|...)."""

from hydra.core.config_store import ConfigStore

from configs.schema import AttnConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig
from model.attention import ATTENTIONS


def register_configs(train_schema: type = TrainConfig) -> None:
    """train_schema: TrainConfig, or a subclass that adds a script's own keys."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=train_schema)
    for name in ATTENTIONS:
        cs.store(group="attn", name=name, node=AttnConfig(name=name))
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
