"""The run configuration: the schema (schema.py: one dataclass per section, one docstring per
field), the YAML and `--set` machinery (parsing.py), the range and cross-field rules
(validation.py), and loading.py, which puts them together. Loading a config imports neither
torch nor megatron-core, so a config error costs a fraction of a second (tools/check_imports.py
enforces it).

    cfg = load_config("examples/tiny_moe_larger_digit.yaml", ["parallel.tensor=2"])

May import: the settings dataclasses of actor, algorithms, parallel and rollout (torch-free
modules only); nothing of run, driver, trainer or cli.
"""
from gspo_megatron.config.loading import config_from_dict, load_config
from gspo_megatron.config.parsing import ConfigError, field_docs, parse_override
from gspo_megatron.config.schema import (CheckpointConfig, DistillConfig, EvalConfig, LoggingConfig, LossConfig,
                                         ModelConfig, RolloutConfig, RunConfig, SyncConfig, TrainConfig,
                                         describe_fields)

__all__ = ["CheckpointConfig", "ConfigError", "DistillConfig", "EvalConfig", "LoggingConfig", "LossConfig",
           "ModelConfig", "RolloutConfig", "RunConfig", "SyncConfig", "TrainConfig", "config_from_dict",
           "describe_fields", "field_docs", "load_config", "parse_override"]
