"""Bounded staleness of asynchronous rollouts (train.max_staleness > 0; docs/async.md).

    groups, metrics = take_fresh_groups(producer, 16, live=7, oldest=6, policy="regenerate")

A group's version is the oldest weight version among its trained tokens (a partial response cut
by a weight sync has two). At live version V it may train only if that version is >= `oldest`
(V - max_staleness, or later when the trainer lacks older weights to recompute pi_old with); a
staler group is generated again from its prompt, or dropped, and counted.
"""
from __future__ import annotations

import statistics
from typing import Callable

from rollout.generation.async_rollouts import AsyncRollouts
from rollout.generation.step_metrics import episode_metrics
from rollout.generation.sample import Sample

# manager metrics that add up over the rollout thread's batches between two trainer steps
_COUNTS = ("groups_dropped_equal_reward", "samples_resumed", "groups_partial_buffered",
           "reward_errors", "response_tokens", "rollout_seconds", "prompts_drawn", "batches",
           "reward_timeouts", "reward_worker_restarts", "reward_seconds", "reward_wait_seconds",
           "reward_sandbox_failures", "groups_dropped_sandbox",
           "teacher_seconds", "teacher_tokens")


def sample_version(sample: Sample) -> int | None:
    """The oldest weight version among the sample's trained tokens; None without any."""
    versions = [int(v) for v, m in zip(sample.weight_versions, sample.loss_mask) if m and v.isdigit()]
    return min(versions) if versions else None


def group_version(group: list[Sample]) -> int | None:
    versions = [v for v in map(sample_version, group) if v is not None]
    return min(versions) if versions else None


def take_fresh_groups(producer: AsyncRollouts, n: int, live: int, oldest: int | None, policy: str,
                      should_stop: Callable[[], bool] | None = None,
                      ) -> tuple[list[list[Sample]], dict[str, float]] | None:
    """The next `n` groups the rollout thread finished that are fresh enough for version `live`
    (None when should_stop said so while waiting: what was taken goes back), with the rollout
    metrics since the last call and the staleness ones."""
    waiting = len(producer.queue)
    taken: list[list[Sample]] = []
    dropped = regenerated = 0
    while len(taken) < n:
        try:
            got = producer.take(n - len(taken), should_stop)
        except BaseException:  # the rollout thread failed (no server left): nothing taken is lost
            producer.put_back(taken)
            raise
        if got is None:
            producer.put_back(taken)
            return None
        stale = [g for g in got if oldest is not None and (group_version(g) or live) < oldest]
        taken += [g for g in got if not any(g is s for s in stale)]
        if stale and policy == "drop":
            dropped += len(stale)
        elif stale:
            producer.regenerate(stale)
            regenerated += len(stale)
    m = producer.pop_metrics()
    samples = [s for g in taken for s in g]
    ages = [live - v for v in map(sample_version, samples) if v is not None] or [0]
    out = {k: float(m.get(k, 0.0)) for k in _COUNTS}
    out.update(
        truncated_fraction=sum(s.finish_reason in ("length", "budget") for s in samples) / max(1, len(samples)),
        rollout_tokens_per_second=out["response_tokens"] / max(out["rollout_seconds"], 1e-9),
        staleness_mean=statistics.fmean(ages), staleness_max=float(max(ages)),
        dropped_stale=float(dropped), regenerated_stale=float(regenerated), buffer_groups=float(waiting))
    if any(s.metadata.get("turn_rewards") is not None or "env_error" in s.metadata for s in samples):
        out.update(episode_metrics(samples))
    return taken, out
