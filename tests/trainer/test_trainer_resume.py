"""Kill a training run with SIGKILL after a checkpoint, resume it, and compare its per-step metrics
with an uninterrupted run of the same seeds: they must match.

Rollouts must be deterministic for that. SGLang's seeded sampling (`sampling_seed`, rollout.seed)
needs its deterministic-inference mode, which it refuses on the CPU attention backend, so on CPU
this test samples greedily (rollout.top_k=1; log-probs still of the full softmax). Greedy groups
have equal rewards (zero advantages), so the RL updates here are zero; the weights that decide the
rollouts come from a short supervised warm start (through the same actor and optimizer) and must be
restored exactly, as must the prompt cursor, the loop state and the TensorBoard/jsonl history. The
exact optimizer/scheduler/RNG round trip is tests/checkpoint/test_checkpoint_manager.py.
"""
from __future__ import annotations

import math
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_trainer_e2e import ROOT, base_overrides, env, run_train, server_url, train_cmd  # noqa: F401

STEPS = 4


def _args(run_dir: Path, url: str) -> list[str]:
    return ["examples/tiny_moe_larger_digit.yaml", *base_overrides(
        run_dir, url, **{"train.steps": STEPS, "rollout.top_k": 1, "train.warm_start_steps": 3,
                         "train.warm_start_lr": 3e-3, "train.warm_start_batch_size": 8,
                         "checkpoint.keep": 0})]


def _measures_time(tag: str) -> bool:
    """A tag that measures how fast the machine was (seconds, throughput, busy fractions), not what
    the run computed: two runs of the same seeds agree on every other tag."""
    return tag.startswith(("time/", "perf/")) or tag in {
        "reward/p99_ms", "distill/teacher_time", "distill/teacher_tokens_per_s", "async/rollout_busy",
        "async/train_busy", "async/overlap"}


def _compare(a: list[dict], b: list[dict]) -> list[str]:
    diffs = []
    for ra, rb in zip(a, b):
        for k, va in ra.items():
            if _measures_time(k):
                continue
            vb = rb.get(k)
            if vb is None or not math.isclose(va, vb, rel_tol=1e-5, abs_tol=1e-6):
                diffs.append(f"step {ra['step']} {k}: {va} vs {vb}")
    return diffs


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_uninterrupted_run(tmp_path, server_url):  # noqa: F811
    from gspo_megatron.run.metrics import read_jsonl, read_scalars
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref = run_train(_args(ref_dir, server_url))
    assert ref.returncode == 0, ref.stderr[-5000:]

    proc = subprocess.Popen(train_cmd(1) + _args(run_dir, server_url), cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run_dir / "ckpt" / "step_00000002" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never wrote its step-2 checkpoint"
    resumed = run_train(_args(run_dir, server_url))
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout

    want, got = read_jsonl(ref_dir / "tb" / "metrics.jsonl", steps_only=True), read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert not _compare(want, got), "\n".join(_compare(want, got))
    # TensorBoard shows one value per step (the interrupted run's later steps purged).
    rewards = read_scalars(run_dir / "tb")["rollout/reward_mean"]
    assert [s for s, _ in rewards] == list(range(STEPS))
