"""Rewards: what scores a response, and the worker processes that run it.

    from rollout.rewards import get_reward, RewardWorkerPool
    pool = RewardWorkerPool("math", workers=8, timeout_s=60)    # the trainer's way (workers.py)
    get_reward("math")(record, response_text)                  # one sample, in this process

Rewards are the rows of REWARDS (registry.py: each names its module and its own settings), beside a
reward service over HTTP (http_service.py) and yours as package.module:function (or a RewardSpec).
Error accounting: scoring.py.
"""
from rollout.rewards.answers import (RewardFn, exact_match_reward, extract_answer, format_reward, last_boxed,
                                     weighted_sum)
from rollout.rewards.math_answers import delimit_gold, math_reward
from rollout.rewards.registry import Reward, RewardSpecError, batched, check_reward, get_reward
from rollout.rewards.scoring import (RewardErrorBudget, RewardErrorBudgetExceeded, Score, ThreadScorer,
                                     as_reward)
from rollout.rewards.workers import RewardWorkerError, RewardWorkerPool

__all__ = ["Reward", "RewardErrorBudget", "RewardErrorBudgetExceeded", "RewardFn", "RewardSpecError",
           "RewardWorkerError", "RewardWorkerPool", "Score", "ThreadScorer", "as_reward", "batched",
           "check_reward", "delimit_gold", "exact_match_reward", "extract_answer", "format_reward",
           "get_reward", "last_boxed", "math_reward", "weighted_sum"]
