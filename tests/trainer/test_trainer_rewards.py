"""Rewards that misbehave in real runs (`gspo-megatron train` against the session's SGLang server):
a call that hangs, one that kills its worker (os._exit), one that returns NaN and one that raises,
in the synchronous and the asynchronous loop. The run completes every step; each hung call is
scored 0 within rollout.reward_timeout_s + 2 s and counted; past the error budget, the run stops
with one line naming the cause."""
from __future__ import annotations

import json

import pytest

from test_trainer_e2e import base_overrides, run_train, server_url  # noqa: F401  (server_url: a fixture)

CONFIG = "examples/tiny_moe_larger_digit.yaml"
TIMEOUT_S = 2.0


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_a_run_survives_hung_crashing_nan_and_raising_rewards(tmp_path, server_url, max_staleness,  # noqa: F811
                                                            monkeypatch):
    from gspo_megatron.run.metrics import read_jsonl
    monkeypatch.setenv("GSPO_TEST_REWARD_COUNTER", str(tmp_path / "calls"))
    steps = 2
    proc = run_train([CONFIG, *base_overrides(tmp_path, server_url, **{
        "train.steps": steps, "train.max_staleness": max_staleness,
        "rollout.reward": "reward_functions:by_call_number", "rollout.reward_workers": 2,
        "rollout.reward_timeout_s": TIMEOUT_S, "rollout.max_reward_error_fraction": 0.7,
        "rollout.group_size": 4, "rollout.prompts_per_step": 4,
        "logging.rollout_records": str(tmp_path / "records.jsonl")})])
    assert proc.returncode == 0, proc.stderr[-5000:]
    recs = read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)
    assert [r["step"] for r in recs] == list(range(steps))
    total = lambda tag: sum(r[tag] for r in recs)  # noqa: E731
    assert total("reward/timeouts") >= 1 and total("reward/worker_restarts") > total("reward/timeouts")
    assert total("rollout/reward_errors") >= total("reward/worker_restarts")
    samples = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    errors = [s["reward_error"] for s in samples if s["reward_error"]]
    hung = [s for s in samples if s["reward_error"] and "reward_timeout_s" in s["reward_error"]]
    assert hung and all(s["reward"] == 0.0 and s["metadata"]["reward_seconds"] < TIMEOUT_S + 2 for s in hung)
    assert any("exited with code 3" in e for e in errors)
    assert any("returned nan" in e for e in errors)
    assert any("KeyError: 'thirteen'" in e for e in errors)
    assert max(r["reward/p99_ms"] for r in recs) < (TIMEOUT_S + 2) * 1000
    # the first failure is said once, each step's count is in its progress line
    first = [ln for ln in proc.stdout.splitlines() if ln.startswith("[gspo] reward error, the first of this run")]
    assert len(first) == 1, first
    progress = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [f"({r['rollout/reward_errors']:.0f} reward error" in ln for r, ln in zip(recs, progress)] == \
        [r["rollout/reward_errors"] > 0 for r in recs], progress
    print({t: total(t) for t in ("reward/timeouts", "reward/worker_restarts", "rollout/reward_errors",
                                 "time/reward", "time/reward_wait")})


@pytest.mark.slow
def test_past_the_error_budget_the_run_stops_with_one_line_naming_the_cause(tmp_path, server_url):  # noqa: F811
    prompts = tmp_path / "nan.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i), "misbehave": "nan"}) + "\n"
                               for i in range(8)))
    proc = run_train([CONFIG, *base_overrides(tmp_path, server_url, **{
        "rollout.prompts": str(prompts), "rollout.reward": "reward_functions:misbehaving",
        "train.warm_start_steps": 0})])
    assert proc.returncode == 3  # a runtime stop (2 is for the inputs)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gspo-megatron: error: the reward (or environment) failed 1 of ") and \
        "returned nan (expected a finite number)" in last, proc.stderr[-3000:]
