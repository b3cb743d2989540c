"""Reward workers (rollout/rewards/workers.py): every way a call can fail ends in a counted Score of
0.0, bounded in time, and the pool goes on with a replaced worker; prepare() once per prompt;
batched rewards; nothing left behind."""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from rollout.rewards import RewardWorkerError, RewardWorkerPool

TESTS = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # the workers get the caller's sys.path


def _workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "rollout.rewards.worker_main" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_each_failure_is_scored_zero_bounded_and_counted_and_the_pool_goes_on():
    timeout = 1.5
    with RewardWorkerPool("reward_functions:misbehaving", workers=2, timeout_s=timeout) as pool:
        pool.wait_ready()
        texts = ["fine", "hang", "fine", "exit", "segfault", "nan", "inf", "string", "raise", "fine"]
        t0 = time.monotonic()
        scores = pool.submit([{"answer": "x"}] * len(texts), texts).result(timeout=60)
        assert time.monotonic() - t0 < timeout + 2 + 1  # one hang: one bound, plus restarts
        got = {t: s for t, s in zip(texts, scores)}
        assert [s.reward for s in scores] == [1.0, 0, 1.0, 0, 0, 0, 0, 0, 0, 1.0]
        assert got["hang"].status == "timeout" and got["hang"].seconds < timeout + 2
        assert "reward_timeout_s=1.5 s; its worker was killed and replaced" in got["hang"].error
        assert got["exit"].status == "died" and "exited with code 3" in got["exit"].error
        assert got["segfault"].status == "died" and "SIGSEGV" in got["segfault"].error
        assert got["nan"].status == "error" and "returned nan (expected a finite number)" in got["nan"].error
        assert "returned inf" in got["inf"].error
        assert "returned 'high' of type str (expected a number)" in got["string"].error
        assert got["raise"].error == "KeyError: 'no such thing'"
        assert pool.restarts == 3
        assert len(_workers()) == 2  # replaced
        # and it goes on
        assert [s.reward for s in pool.submit([{}] * 3, ["a", "b", "c"]).result(timeout=30)] == [1.0] * 3
    assert _workers() == []  # close() leaves no process


@pytest.mark.slow
def test_prepare_runs_once_per_prompt_and_batched_rewards_get_the_group():
    with RewardWorkerPool("reward_functions:counting", workers=1, timeout_s=30) as pool:
        a = pool.submit([{"p": "a"}] * 4, ["x"] * 4).result(timeout=30)
        b = pool.submit([{"p": "b"}] * 4, ["x"] * 4).result(timeout=30)
        assert [s.reward for s in a] == [1.0] * 4 and [s.reward for s in b] == [2.0] * 4
    with RewardWorkerPool("reward_functions:lengths", workers=1, timeout_s=30) as pool:
        scores = pool.submit([{}] * 3, ["a", "bb", "ccc"]).result(timeout=30)
        assert [s.reward for s in scores] == [1.0, 2.0, 3.0] and pool.batched
    with RewardWorkerPool("reward_functions:wrong_length", workers=1, timeout_s=30) as pool:
        scores = pool.submit([{}] * 2, ["a", "b"]).result(timeout=30)
        assert all("returned 1 values for 2 responses" in s.error for s in scores)


@pytest.mark.slow
def test_a_reward_that_cannot_be_built_in_a_worker_is_one_error():
    pool = RewardWorkerPool("reward_functions_missing:fn", workers=2, timeout_s=5)
    try:
        with pytest.raises(RewardWorkerError, match="reward_functions_missing:fn.*ModuleNotFoundError"):
            pool.wait_ready(timeout_s=60)
        with pytest.raises(RewardWorkerError):
            pool.submit([{}], ["x"])
    finally:
        pool.close()
    assert _workers() == []
