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

from gspo_megatron.config.parsing import apply_overrides, build, read_yaml_mapping
from gspo_megatron.config.schema import RunConfig
from gspo_megatron.config.validation import validate


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig from a mapping of sections and `a.b=c` overrides."""
    data = apply_overrides(copy.deepcopy(dict(data or {})), list(overrides or []))
    cfg = build(RunConfig, data)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (None: defaults only), apply `a.b=c` overrides, validate.

    Relative paths in the file (model.hf_path, rollout.prompts) stay relative to the working
    directory, as the user typed them."""
    return config_from_dict(read_yaml_mapping(path) if path is not None else {}, overrides)
