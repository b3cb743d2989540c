"""A run config from YAML or a mapping: parsed, overridden, built and checked, in that order.

    cfg = load_config("examples/tiny_moe_larger_digit.yaml", ["parallel.tensor=2"])
    cfg = config_from_dict({"loss": {"name": "grpo"}, ...})

Building checks the types and each section's own rules (parsing.py, the sections'
__post_init__); validation.py then checks the ranges and the rules across sections.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from gspo_megatron.config.parsing import ConfigError, apply_overrides, build, read_yaml_mapping
from gspo_megatron.config.schema import MOVED, RunConfig
from gspo_megatron.config.validation import validate
from gspo_tables import TableError, import_plugins


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig from a mapping of sections and `a.b=c` overrides; the `plugins:`
    modules are imported first, so that the rows they register are there to be named."""
    data = apply_overrides(copy.deepcopy(dict(data or {})), list(overrides or []))
    _refuse_moved(data)
    plugins = data.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError(f"plugins={plugins!r}: expected a list of module names")
    try:
        import_plugins(plugins)
    except TableError as e:
        raise ConfigError(str(e)) from None
    cfg = build(RunConfig, data)
    validate(cfg, data)
    return cfg


def _refuse_moved(data: dict[str, Any]) -> None:
    """A key that moved into a row's own settings is refused in one line naming where it is now."""
    for old, new in MOVED.items():
        section, _, key = old.partition(".")
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            raise ConfigError(f"{old}={node[key]!r}: moved; write {new}")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (None: defaults only), apply `a.b=c` overrides, validate.

    Relative paths in the file (model.hf_path, rollout.prompts) stay relative to the working
    directory, as the user typed them."""
    return config_from_dict(read_yaml_mapping(path) if path is not None else {}, overrides)
