"""GSPO, GSPO-token and GRPO losses, group advantages and KL penalty: pure torch, no megatron.

See ../shared/GSPO.md for the equations; tests/test_algorithms_*.py prove its properties 1-12.
"""
from .advantages import group_advantages
from .grpo import grpo_loss
from .gspo import gspo_loss, gspo_token_loss
from .kl import KL_ESTIMATORS, kl_penalty, token_kl
from .metrics import METRIC_REDUCTIONS, combine_metrics, finalize_metrics
from .rows import LOG_RATIO_CLAMP

# The loss a run uses is chosen by name from its config (one field, logged at start-up).
# "gspo_token" takes per-token advantages [b, s]; the others one per sequence [b].
LOSS_FUNCTIONS = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}

__all__ = [
    "group_advantages", "gspo_loss", "gspo_token_loss", "grpo_loss", "kl_penalty", "token_kl",
    "LOSS_FUNCTIONS", "KL_ESTIMATORS", "METRIC_REDUCTIONS", "combine_metrics", "finalize_metrics", "LOG_RATIO_CLAMP",
]
