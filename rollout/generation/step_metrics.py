"""What one rollout step reports (RolloutManager.generate_step's metrics): rewards, lengths,
truncation, partial rollouts, scoring and teacher time, and for multi-turn episodes their turns,
tool calls and environment tokens. The trainer's rollout/* metrics are made of these (gspo_megatron/driver/rollout_metrics.py).
"""
from __future__ import annotations

from rollout.generation.sample import Sample
from rollout.rewards.scoring import RewardErrorBudget


class StepCounts(dict[str, float]):
    """A step's counters and timers by name: one never counted reads 0 and is not reported
    (collections.Counter's way, for seconds as well as counts)."""

    def __missing__(self, key: str) -> float:
        return 0


def step_metrics(kept: list[list[Sample]], m: StepCounts, seconds: float, *, buffer_groups: int,
                 budget: RewardErrorBudget, episodes: bool) -> dict[str, float]:
    """The step's counters `m` and the kept groups' summary; budget: the run's reward errors."""
    samples = [s for g in kept for s in g]
    n = max(1, len(samples))
    resp_tokens = sum(len(s.response_ids) for s in samples)
    out = {k: float(v) for k, v in m.items()}
    out.update({
        "reward_mean": sum(s.score for s in samples) / n,
        "response_length_mean": resp_tokens / n,
        # cut by the token budget: a response at max_new_tokens, an episode out of budget
        "truncated_fraction": sum(s.finish_reason in ("length", "budget") for s in samples) / n,
        "multi_segment_fraction": sum(s.num_segments > 1 for s in samples) / n,
        "buffer_groups": float(buffer_groups),
        "reward_error_fraction_total": budget.errors / max(1, budget.calls),
        "rollout_seconds": seconds,
        "response_tokens": float(resp_tokens),
        "rollout_tokens_per_second": resp_tokens / max(seconds, 1e-9),
    })
    if episodes:
        out.update(episode_metrics(samples))
    return out


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn episodes: turns and tool calls per episode, the share of environment tokens,
    reward per turn, episode length (prompt excluded) and how many ended on an environment error."""
    n = max(1, len(samples))
    turns = sum(len(s.metadata.get("turn_rewards", [])) for s in samples)
    env_tokens = sum(len(s.loss_mask) - sum(1 for k in s.loss_mask if k) for s in samples)
    tokens = sum(len(s.response_ids) for s in samples)
    return {"turns_per_episode": turns / n,
            "tool_calls_per_episode": sum(s.metadata.get("tool_calls", 0) for s in samples) / n,
            "env_token_fraction": env_tokens / max(1, tokens),
            "reward_per_turn": sum(sum(s.metadata.get("turn_rewards", [])) for s in samples) / max(1, turns),
            "episode_length_mean": tokens / n,
            "env_error_fraction": sum("env_error" in s.metadata for s in samples) / n}
