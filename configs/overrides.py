"""Command-line overrides: a value written so that Hydra reads back exactly that string, which
overrides may add or delete keys, and composing a config from them with every error in one line
(compose_checked, one_line).

Hydra's override grammar takes unquoted values of plain ASCII only: a path with a space, an `ü`, a
quote or a `${` must be quoted, or the run cannot start or resume (preflight hands Hydra the run
dir as an override). A command-line value Hydra cannot read as it stands is quoted for it
(quoted_where_needed), so `hydra.run.dir=/data/ü_日本` works as typed. A comma separates the values
of a sweep: without -m, a string key's value with a comma (`prompt=To be, or not`, `hydra.run.dir=/a,b`)
is quoted too, as it can only mean that string; any other comma, and one under -m, stays a sweep's,
and where it cannot be one the error says how to quote it.

`+key=` and `++key=` add a key where the schema has none, bypassing the typo
check of configs/schema.py, and `~key` deletes one the training needs: additions are refused
unless they name an existing key, a config group or one of Hydra's own, deletions unless Hydra's.
"""

import dataclasses
import difflib
import re
import shlex
import typing
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.conf import HydraConf
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from configs.validate import ConfigError

_PARSER = OverridesParser.create()


def _reads_back(key: str, text: str, value: str) -> bool:
    try:
        return _PARSER.parse_override(f"{key}={text}").value() == value
    except HydraException:
        return False


def quote(value: str) -> str:
    """value in Hydra's double-quoted form: a backslash is literal unless it precedes a quote or the
    end, and `${` starts an interpolation unless escaped."""
    text = value.replace("${", "\\${")
    text = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return f'"{text}"'


def override(key: str, value: str) -> str:
    """`key=value` as one command-line argument that Hydra reads back as exactly `value` (a
    string); plain where that needs no quotes."""
    plain = "${" not in value and _reads_back(key, value, value)
    return f"{key}={value if plain else quote(value)}"


def _holds_string(schema: type, key: str) -> bool:
    """Whether `key` (dotted; `hydra.` keys are Hydra's own) is a string key of dataclass `schema`."""
    parts = key.lstrip("+").split(".")
    node = HydraConf if parts[0] == "hydra" else schema
    for part in parts[1:] if parts[0] == "hydra" else parts:
        node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
    return node in (str, Optional[str])


def quoted_where_needed(argv: list[str], schema: type) -> list[str]:
    """argv with each `key=value` that Hydra cannot parse as it stands, but can once its value is
    quoted, quoted; without -m, also a value with a comma of a string key of `schema` (the
    dataclass of the app's config); everything else as it was (Hydra reports it)."""
    sweep = any(arg in ("-m", "--multirun") for arg in argv)
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and not arg.startswith("-") and re.fullmatch(r"[+~]*[\w.@/-]+", key):
            try:
                parsed = _PARSER.parse_override(arg).value()
                needed = (not sweep and isinstance(parsed, ChoiceSweep) and parsed.simple_form
                          and _holds_string(schema, key))
            except HydraException:
                needed = True
            if needed and _reads_back(key, quote(value), value):
                arg = f"{key}={quote(value)}"
        out.append(arg)
    return out


def shell_override(key: str, value: str) -> str:
    """override(key, value) as a user types it into a POSIX shell."""
    return shlex.quote(override(key, value))


def check_additions(overrides: list[str], composed: DictConfig, groups: set[str]) -> None:
    """ConfigError for a `+key=`/`++key=` that names no key of `composed` (the config without
    those overrides), or a `~key` deletion, unless the key is Hydra's or a config group's."""
    try:
        parsed = _PARSER.parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports it, in one line (trainer/preflight.py)
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if o.is_delete():
            raise ConfigError(f"{o.input_line}: deleting a key or a config group is not supported (the training "
                              "reads every key of configs/schema.py): override its value instead")
        if key in groups:
            continue
        if (o.is_add() or o.is_force_add()) and OmegaConf.select(composed, key, default=_ABSENT) is _ABSENT:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(composed, parent) if parent else composed
            near = difflib.get_close_matches(leaf, list(node.keys()) if isinstance(node, DictConfig) else [], n=1)
            hint = f"; did you mean {parent + '.' if parent else ''}{near[0]}?" if near else ""
            raise ConfigError(f"{o.input_line}: {key} is not a key of the config (configs/schema.py), and "
                              f"+/++ may not add one{hint}")


_ABSENT = object()


def one_line(e: Exception) -> str:
    """A Hydra/OmegaConf composition error as one line: what was wrong and what is allowed."""
    lines = [line.strip() for line in str(e).split("Config search path:")[0].splitlines() if line.strip()]
    options = [line for line in lines[1:] if not line.endswith(":") and not line.endswith("_schema")]
    ambiguous = re.fullmatch(r"Ambiguous value for argument '(.*)'", lines[0]) if lines else None
    if ambiguous:  # Hydra's advice, key='a,b', loses its quotes in a shell: the quoting that survives one
        key, _, value = ambiguous.group(1).partition("=")
        text = (f"{ambiguous.group(1)}: a comma separates the values of a sweep: add -m to run one job per "
                f"value, or quote the value to keep its comma: {shell_override(key, value)}")
    elif lines and "Available options" in str(e):
        missing = re.search(r"Could not find '[^']*?([^/']+)'", lines[0])
        close = difflib.get_close_matches(missing.group(1), options, n=1) if missing else []
        text = f"{lines[0]}; choose one of: {', '.join(options)}" + (f" (did you mean {close[0]}?)" if close else "")
    else:
        # Hydra's advice to append with +key= is refused here (configs/overrides.py): left out
        text = "; ".join(line for line in lines if not line.startswith(("See https://", "To append to your config")))
    if e.__cause__ is not None:
        text += ": " + str(e.__cause__).splitlines()[0]
    return text


def task_config(cfg: DictConfig) -> DictConfig:
    """cfg without Hydra's own keys."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def compose_checked(config_dir: Path, config_name: str | None, overrides: list[str],
                    return_hydra_config: bool = False) -> DictConfig:
    """The config these overrides compose to, every value resolvable: an override's ${...} is
    resolved here, not where its value is first read (the run dirs among Hydra's keys too).
    ConfigError in one line where they do not compose or resolve."""
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=return_hydra_config)
        OmegaConf.to_container(task_config(cfg), resolve=True)
        if return_hydra_config:
            str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)
        return cfg
    except InterpolationResolutionError as e:  # an override's: the config files' all resolve
        reason = str(e).splitlines()[0].removeprefix("KeyError raised while resolving interpolation: ").strip('"')
        typed = [o for o in overrides if "${" in o] or [str(e.full_key)]
        raise ConfigError(f"{', '.join(typed)}: {reason[:1].lower()}{reason[1:]}: an override's ${{...}} names a key "
                          "of the config or a resolver such as ${oc.env:HOME}; write a literal ${ as \\${") from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_unknown_key(e, config_dir, config_name, overrides) or one_line(e)) from None


def _unknown_key(e: Exception, config_dir: Path, config_name: str | None, overrides: list[str]) -> str | None:
    """For an override of a key the config does not have: one line naming it, the closest keys and
    where every key is listed; None for any other error."""
    typed = re.fullmatch(r"Could not override '(.+)'\.", str(e).splitlines()[0] if str(e) else "")
    if typed is None:
        return None
    key = typed.group(1)
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        keys = _dotted(OmegaConf.to_container(compose(config_name), resolve=False))
    leaf = key.rsplit(".", 1)[-1]
    near = [k for k in keys if k.rsplit(".", 1)[-1] == leaf] + difflib.get_close_matches(key, keys, n=3, cutoff=0.8)
    near += [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.8)]
    near = list(dict.fromkeys(k for k in near if k != key))[:3]
    given = next((o for o in overrides if o.lstrip("+").partition("=")[0] == key), key)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return f"{given}: no such key{hint}; every key, with its default: configs/schema.py"


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """The dotted names of a nested dict's leaf keys."""
    out = []
    for k, v in tree.items():
        out += _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out
