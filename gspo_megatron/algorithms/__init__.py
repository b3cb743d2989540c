"""GSPO, GSPO-token and GRPO losses, group advantages and KL penalty: pure torch, no megatron.

The equations and the properties the tests prove are in docs/algorithm.md (the paper: arXiv
2507.18071); tests/algorithms/ prove its properties 1-12. The loss table (names, clip ranges,
metric keys) is registry.py. Names are imported on first use (PEP 562), so that reading the
registry (config validation) does not import torch.

May import: torch only (no megatron, no other package of gspo_megatron).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "gspo_loss": "gspo", "gspo_token_loss": "gspo", "grpo_loss": "grpo",
    "kl_penalty": "kl", "token_kl": "kl", "combine_metrics": "loss_metrics",
    "finalize_metrics": "loss_metrics", "LOG_RATIO_CLAMP": "rows", "KL_ESTIMATORS": "terms", "AGGREGATIONS": "terms",
    "METRIC_REDUCTIONS": "registry", "LOSSES": "registry", "LossSettings": "registry",
}


if TYPE_CHECKING:  # the names as the checker sees them; at run time __getattr__ imports them
    from gspo_megatron.algorithms.grpo import grpo_loss
    from gspo_megatron.algorithms.gspo import gspo_loss, gspo_token_loss
    from gspo_megatron.algorithms.kl import kl_penalty, token_kl
    from gspo_megatron.algorithms.loss_metrics import combine_metrics, finalize_metrics
    from gspo_megatron.algorithms.registry import LOSSES, METRIC_REDUCTIONS, LossSettings
    from gspo_megatron.algorithms.rows import LOG_RATIO_CLAMP
    from gspo_megatron.algorithms.terms import AGGREGATIONS, KL_ESTIMATORS
    LOSS_FUNCTIONS: dict[str, Callable[..., Any]]
else:
    def __getattr__(name: str) -> Any:
        if name == "LOSS_FUNCTIONS":  # the RL losses by config name
            from .registry import LOSSES
            return {n: s.loss_function() for n, s in LOSSES.items() if s.rl}
        if name in _EXPORTS:
            return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS) + ["LOSS_FUNCTIONS"]
