"""What a resume may change: every key of the config is either allowed or refused, and each answer is right.

- every key of train.py's config, changed on resume: the keys that leave it the same run (how long it
  runs and what it reports; the same function on the same batches; the lr schedule) are accepted and
  listed, every other key is refused in one line naming it (attn.window among them);
- each key accepted as "the same function" continues the run for real: a resume that changes it gives
  the uninterrupted run's losses within fp32 rounding, where a changed window changes them.

    .venv/bin/python -m pytest tests/test_resume_rules.py -q
"""

import shutil

import pytest

import train as train_module
from configs.schema import plain
from configs.validate import FSDP_ONLY, ConfigError, check_resume
from tests.helpers import TINY, compose, metrics

# how long it runs, what it reports and samples (model.name labels the shape)
REPORTING = {"max_steps", "log_interval", "eval_interval", "eval_steps", "ckpt_interval", "sample_tokens",
             "sample_prompt", "profile", "resume", "model.name", "wandb.project", "wandb.mode", "wandb.entity",
             "wandb.group", "wandb.name", "wandb.tags"}
# the same function on the same batches, computed elsewhere or by other kernels
SAME_FUNCTION = {"device", "compile", "compile_mode", "ac", "attn.name", "attn.sdpa_backend", "attn.backend",
                 "model.loss", "model.loss_chunk", "model.mlp_chunk", "parallel.cp", "parallel.param_dtype",
                 "parallel.reshard_after_forward", "parallel.unit_params", "parallel.cp_rotate",
                 "parallel.cp_head_groups", "data.root", "data.cycle"}
SCHEDULE = {"optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.grad_clip"}
# another model, other data or masks, other batches or seeds, another precision or optimizer
REFUSED = {"seq_len", "batch_size", "grad_accum", "seed", "data_seed", "dtype", "attn.window", "model.n_layer",
           "model.n_head", "model.n_kv_head", "model.d_model", "model.max_seq_len", "model.vocab_size",
           "model.pos_emb", "model.rope_theta", "model.dropout", "model.bias", "model.z_loss", "data.name",
           "data.source", "data.hf_path", "data.hf_name", "data.hf_split", "data.text_field", "data.max_docs",
           "data.val_fraction", "data.doc_mask", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps",
           "parallel.dp", "attn.softcap", "attn.alibi", "attn.sinks", "attn.prefix", "attn.window_warmup",
           "model.window_pattern"}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def changed(value):
    """Another value of value's type (check_resume compares values; it does not validate them)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, list):
        return [*value, "x"]
    return f"{value}x" if isinstance(value, str) else "x"


def with_key(config: dict, key: str, value) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    *parents, leaf = key.split(".")
    node = out
    for p in parents:
        node = node[p]
    node[leaf] = value
    return out


CONFIG = plain(compose(TINY))


def test_every_key_is_either_allowed_or_refused_on_resume():
    keys = set(flat(CONFIG)) - {"batch_tokens"}  # a way to set the global batch, compared as batch_size
    classified = REPORTING | SAME_FUNCTION | SCHEDULE | REFUSED
    assert keys == classified, keys ^ classified


@pytest.mark.parametrize("key", sorted(set(flat(CONFIG)) - {"batch_tokens"}))
def test_a_resume_that_changes_a_key_is_refused_unless_it_keeps_the_run(key):
    old = flat(CONFIG)[key]
    new = changed(old)
    ckpt = {"config": CONFIG, "world_size": 1, "data_parallel": 1}
    now = with_key(CONFIG, key, new)
    shown = "global batch_size" if key == "batch_size" else key
    if key in REFUSED:
        with pytest.raises(ConfigError) as refused:
            check_resume(ckpt, now, 1, "run")
        message = str(refused.value)
        assert "\n" not in message and f"resume=run: {shown} {old} -> " in message
        assert "would not continue the same run" in message
    else:  # how FSDP would gather weights is no change to this (DDP) run
        quiet = key == "resume" or key in FSDP_ONLY
        assert check_resume(ckpt, now, 1, "run") == ("" if quiet else f"{shown} {old} -> {new}")


def test_a_sharded_resume_lists_fsdp_settings_and_an_older_checkpoint_gathered_each_block_alone():
    older = with_key(CONFIG, "parallel.param_dtype", "float32")  # the default then
    del older["parallel"]["unit_params"]  # written before the key existed
    now = with_key(CONFIG, "parallel.dp", "fsdp")
    ckpt = {"config": with_key(older, "parallel.dp", "fsdp"), "world_size": 2, "data_parallel": 2}
    assert check_resume(ckpt, now, 2, "run") == "parallel.param_dtype float32 -> auto, parallel.unit_params 1 -> 100000000"
    # a DDP run never gathers: nothing to say
    assert check_resume({"config": older, "world_size": 1, "data_parallel": 1}, CONFIG, 1, "run") == ""


@pytest.fixture(scope="module")
def four_steps(data_root, tmp_path_factory):
    """A run of four steps, and the eight losses of one that goes on: a constant lr after the warmup
    (min_lr_ratio=1), so that the first is the second's first half."""
    tmp = tmp_path_factory.mktemp("resume_rules")
    base = TINY + [f"data.root={data_root}", "log_interval=1", "eval_interval=0", "eval_steps=0",
                   "optim.min_lr_ratio=1", "wandb.mode=disabled"]
    train_module.train(compose(base + ["max_steps=8"]), tmp / "straight")
    train_module.train(compose(base + ["max_steps=4"]), tmp / "stopped")
    return base, tmp / "stopped", [r["loss"] for r in metrics(tmp / "straight")]


@pytest.mark.parametrize("override", ["attn.name=naive", "attn.name=triton", "attn.sdpa_backend=math",
                                      "model.loss=full", "model.loss_chunk=40", "model.mlp_chunk=8", "ac=full",
                                      "ac=selective", "data.cycle=true", "data.root={copy}"])
def test_a_resume_changing_a_same_function_key_continues_the_run(override, four_steps, data_root, tmp_path):
    base, stopped, straight = four_steps
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    if "{copy}" in override:  # the same prepared dataset, moved
        shutil.copytree(data_root, tmp_path / "data")
        override = override.format(copy=tmp_path / "data")
    cfg = compose(base + ["max_steps=8", override, f"resume={run_dir}"])
    assert train_module.train(cfg, tmp_path / "ignored")["status"] == "ok"
    losses = [r["loss"] for r in metrics(run_dir)]
    assert len(losses) == 8 and losses[:4] == straight[:4]
    assert max(abs(a - b) for a, b in zip(losses[4:], straight[4:])) <= 1e-4, (losses, straight)


def test_a_window_changes_the_losses_and_a_resume_that_changes_it_is_refused(four_steps, tmp_path):
    base, stopped, straight = four_steps
    summary = train_module.train(compose(base + ["max_steps=8", "attn.window=4"]), tmp_path / "windowed")
    assert summary["status"] == "ok"
    windowed = [r["loss"] for r in metrics(tmp_path / "windowed")]
    assert max(abs(a - b) for a, b in zip(windowed, straight)) > 1e-2  # another function, not rounding
    with pytest.raises(ConfigError, match=r"attn.window 0 -> 4 would not continue the same run"):
        train_module.train(compose(base + ["max_steps=8", "attn.window=4", f"resume={stopped}"]), tmp_path / "x")
