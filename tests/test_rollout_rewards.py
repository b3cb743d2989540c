"""Reward functions and the reward-error budget (no server)."""
from __future__ import annotations

import pytest

from rollout.rewards import (RewardErrorBudget, RewardErrorBudgetExceeded, exact_match_reward,
                             extract_answer, format_reward, get_reward_fn, last_boxed, math_reward,
                             score_sample, weighted_sum)
from rollout.sample import Sample


def test_extract_answer():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert extract_answer("The answer is 42.") == "42"
    assert extract_answer("nothing here") is None


def test_exact_match_and_format():
    assert exact_match_reward({"answer": "19"}, r"so \boxed{ 19 }") == 1.0
    assert exact_match_reward({"answer": "19"}, "Answer: 18") == 0.0
    assert format_reward()({}, r"think... \boxed{3}") == 1.0
    assert format_reward(r"<think>.*</think>.*")({}, "no tags") == 0.0
    both = weighted_sum([(exact_match_reward, 1.0), (format_reward(), 0.5)])
    assert both({"answer": "3"}, r"\boxed{3}") == 1.5


def test_math_verify_equivalence():
    assert math_reward({"answer": "0.5"}, r"hence \boxed{\frac{1}{2}}") == 1.0
    assert math_reward({"answer": "1/2"}, r"\boxed{0.5}") == 1.0
    assert math_reward({"answer": "3"}, r"\boxed{4}") == 0.0
    assert math_reward({"answer": "3"}, "no answer at all") == 0.0
    assert get_reward_fn("math") is math_reward
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward_fn("nope")


def test_reward_exception_is_recorded_not_raised():
    s = Sample(0, 0, {"prompt": "p"}, [1], 4)
    assert not score_sample(s, math_reward, r"\boxed{1}")  # record has no "answer": KeyError
    assert s.reward == 0.0 and s.reward_error.startswith("KeyError")


def test_error_budget():
    budget = RewardErrorBudget(max_error_fraction=0.25, min_calls=4)
    budget.record(False, "first")  # 1 of 1, but fewer than min_calls: fine
    for _ in range(3):
        budget.record(True)
    budget.record(True)
    with pytest.raises(RewardErrorBudgetExceeded, match="2 of 6"):
        budget.record(False, "second")
    restored = RewardErrorBudget(0.25)
    restored.load_state(budget.to_state())
    assert (restored.calls, restored.errors, restored.last_error) == (6, 2, "second")
