"""The rollout/*, reward/*, distill/* and async/* metrics of a rollout batch (driver, rank 0), from
its samples and the rollout manager's counters (rollout/generation/step_metrics.py).
"""
from __future__ import annotations

import statistics

import torch

from gspo_megatron.algorithms.distill import reverse_kl
from rollout.generation.alignment import misalignment
from rollout.generation.sample import Sample

ALIGNMENT_CHECKS = 8
"""Samples a step checks fully for alignment (rollout/generation/alignment.py), those built from
several generate calls first: a few numpy passes over each one's tokens and routes."""


def rollout_metrics(groups: list[list[Sample]], manager_metrics: dict[str, float]) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    rewards = [s.score for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    m = manager_metrics
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "rollout/response_length_mean": statistics.fmean(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/truncated_fraction": m.get("truncated_fraction", 0.0),
        "rollout/groups_dropped": m.get("groups_dropped_equal_reward", 0.0),
        "rollout/partial_resumed": m.get("samples_resumed", 0.0),
        "rollout/unrouted_dropped": float(sum(s.metadata.get("unrouted_dropped", 0) for s in samples)),
        "rollout/partial_buffered": m.get("groups_partial_buffered", 0.0),
        "rollout/reward_errors": m.get("reward_errors", 0.0),
        **reward_metrics(samples, m),
        **(distill_metrics(samples, m) if any(s.teacher_logprobs is not None for s in samples) else {}),
        "perf/rollout_tokens_per_s": m.get("rollout_tokens_per_second", 0.0),
        **{f"rollout/{k}": m[k] for k in EPISODE_METRICS if k in m},
        **{f"async/{k}": m[k] for k in ASYNC_METRICS if k in m},
    }


def alignment_metrics(samples: list[Sample], checks: int = ALIGNMENT_CHECKS,
                      ) -> tuple[dict[str, float], str | None]:
    """rollout/alignment_checked and rollout/misaligned over `checks` of the samples (those of
    several segments first, then in order), and the first problem found, named (or None)."""
    chosen = sorted(range(len(samples)), key=lambda i: (samples[i].num_segments <= 1, i))[:checks]
    found = [(samples[i], misalignment(samples[i])) for i in chosen]
    bad = [(s, p) for s, p in found if p is not None]
    first = f"sample {bad[0][0].group_id}/{bad[0][0].index}: {bad[0][1]}" if bad else None
    return {"rollout/alignment_checked": float(len(found)), "rollout/misaligned": float(len(bad))}, first


def distill_metrics(samples: list[Sample], m: dict[str, float]) -> dict[str, float]:
    """On-policy distillation: the reverse KL of the student's samples from the teacher (per trained
    token, with the engine's log-probs of the student: pi_old up to train/logprob_abs_diff), and
    the teacher's request time and throughput."""
    mask = torch.tensor([k for s in samples for k in s.loss_mask], dtype=torch.bool)
    student = torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64)
    unscored = [s.index for s in samples if s.teacher_logprobs is None]
    if unscored:
        raise ValueError(f"{len(unscored)} sample(s) have no teacher log-probs: the teacher scores every sample")
    teacher = torch.tensor([lp for s in samples for lp in s.teacher_logprobs or ()], dtype=torch.float64)
    seconds = m.get("teacher_seconds", 0.0)
    return {"distill/reverse_kl": reverse_kl(student, teacher, mask), "distill/teacher_time": seconds,
            "distill/teacher_tokens_per_s": m.get("teacher_tokens", 0.0) / seconds if seconds else 0.0}


def reward_metrics(samples: list[Sample], m: dict[str, float]) -> dict[str, float]:
    """The reward workers' share of the step: timeouts, worker restarts, busy time, the p99 time
    per response, and how long the rollout loop waited on scoring with nothing generating."""
    seconds = sorted(s.metadata["reward_seconds"] for s in samples if "reward_seconds" in s.metadata)
    p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))] if seconds else 0.0
    return {"reward/timeouts": m.get("reward_timeouts", 0.0),
            "reward/worker_restarts": m.get("reward_worker_restarts", 0.0),
            "reward/sandbox_failures": m.get("reward_sandbox_failures", 0.0),
            "reward/groups_dropped_sandbox": m.get("groups_dropped_sandbox", 0.0),
            "reward/p99_ms": 1000.0 * p99,
            "time/reward_wait": m.get("reward_wait_seconds", 0.0),
            "time/reward": m.get("reward_seconds", 0.0)}


EPISODE_METRICS = ("turns_per_episode", "tool_calls_per_episode", "env_token_fraction",
                   "reward_per_turn", "episode_length_mean", "env_error_fraction")
ASYNC_METRICS = ("staleness_mean", "staleness_max", "dropped_stale", "regenerated_stale", "buffer_groups")
