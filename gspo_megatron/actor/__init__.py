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
from typing import Any

_EXPORTS = {
    "Actor": "actor", "TrainBatch": "batching.batch", "MicroBatch": "batching.batch", "balanced_sizes": "batching.batch",
    "micro_batches": "batching.batch", "OptimizerSettings": "settings", "LogProbSettings": "settings",
    "build_model_chunks": "build", "build_optimizer": "build", "check_layout": "build",
    "spec_for_layout": "build", "compute_log_probs": "steps", "train_step": "steps",
    "full_state_dict": "weights", "load_full_state_dict": "weights",
}


def __getattr__(name: str) -> Any:
    if name == "LossSettings":  # the loss table's settings, re-exported for convenience
        from gspo_megatron.algorithms.registry import LossSettings
        return LossSettings
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS) + ["LossSettings"]
