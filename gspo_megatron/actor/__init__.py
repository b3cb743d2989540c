"""The policy model on megatron-core: build for a layout, log-probs on the last pipeline stage,
old log-probs (forward only) and GSPO train steps through megatron's pipeline schedule.

    from gspo_megatron.actor import Actor, TrainBatch, OptimizerSettings, LossSettings

Names are imported on first use (PEP 562): the run config reads `actor.settings` without
importing torch or megatron-core.

May import: algorithms, checkpoint, parallel, model_specs; never config, run, driver, sync,
trainer or cli (tools/check_imports.py).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Actor": "actor", "TrainBatch": "batching.batch", "MicroBatch": "batching.micro_batch", "balanced_sizes": "batching.batch",
    "micro_batches": "batching.micro_batch", "OptimizerSettings": "settings", "LogProbSettings": "settings",
    "build_model_chunks": "build", "build_optimizer": "build", "check_layout": "build",
    "spec_for_layout": "build", "compute_log_probs": "steps", "train_step": "steps",
    "full_state_dict": "weights", "load_full_state_dict": "weights",
}


if TYPE_CHECKING:  # the names as the checker sees them; at run time __getattr__ imports them
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.batching.batch import TrainBatch, balanced_sizes
    from gspo_megatron.actor.batching.micro_batch import MicroBatch, micro_batches
    from gspo_megatron.actor.build import build_model_chunks, build_optimizer, check_layout, spec_for_layout
    from gspo_megatron.actor.settings import LogProbSettings, OptimizerSettings
    from gspo_megatron.actor.steps import compute_log_probs, train_step
    from gspo_megatron.actor.weights.full import full_state_dict, load_full_state_dict
    from gspo_megatron.algorithms.registry import LossSettings
else:
    def __getattr__(name: str) -> Any:
        if name == "LossSettings":  # the loss table's settings, re-exported for convenience
            from gspo_megatron.algorithms.registry import LossSettings
            return LossSettings
        if name in _EXPORTS:
            return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS) + ["LossSettings"]
