"""The shipped text rewards, `reward: math` on the answers datasets store, and the error budget.

math: each pair's expected score is math-verify's own judgment with the gold delimited by hand, and
right answers score 1, wrong ones 0; the pairs are scored the way a run scores them, in a reward
worker (its main thread: math-verify's own timeouts on).
"""
from __future__ import annotations

import time

import pytest

from rollout.rewards import (RewardErrorBudget, RewardErrorBudgetExceeded, RewardSpecError, RewardWorkerPool,
                             delimit_gold, exact_match_reward, extract_answer, format_reward, get_reward,
                             last_boxed, math_reward, weighted_sum)

# (gold as the dataset stores it, the same gold delimited by hand, response, right?)
MATH_PAIRS = [
    # MATH / MATH-500 / DAPO / verl's MATH parquet: LaTeX without $
    (r"2\sqrt{3}", r"$2\sqrt{3}$", r"so the side is \boxed{2\sqrt{3}}.", 1),
    (r"2\sqrt{3}", r"$2\sqrt{3}$", r"\boxed{\sqrt{12}}", 1),
    (r"2\sqrt{3}", r"$2\sqrt{3}$", r"\boxed{2}", 0),  # the old parse scored this 1.0
    (r"3\pi", r"$3\pi$", r"The area is \boxed{3\pi}", 1),
    (r"3\pi", r"$3\pi$", r"\boxed{3}", 0),
    (r"\sqrt{2}", r"$\sqrt{2}$", r"\boxed{\sqrt{2}}", 1),  # the old parse raised
    (r"\sqrt{2}", r"$\sqrt{2}$", r"\boxed{2}", 0),
    (r"\pi", r"$\pi$", r"\boxed{\pi}", 1),
    (r"\pi", r"$\pi$", r"\boxed{3.14}", 0),
    (r"\dfrac{3}{4}", r"$\dfrac{3}{4}$", r"\boxed{\frac{3}{4}}", 1),
    (r"\dfrac{3}{4}", r"$\dfrac{3}{4}$", r"\boxed{0.75}", 1),
    (r"\dfrac{3}{4}", r"$\dfrac{3}{4}$", r"\boxed{\frac{4}{3}}", 0),
    (r"\frac{\sqrt{3}}{2}", r"$\frac{\sqrt{3}}{2}$", r"\boxed{\frac{\sqrt3}{2}}", 1),
    (r"-\frac{1}{2}", r"$-\frac{1}{2}$", r"\boxed{-0.5}", 1),
    (r"-\frac{1}{2}", r"$-\frac{1}{2}$", r"\boxed{\frac{1}{2}}", 0),
    (r"(1, 2]", r"$(1, 2]$", r"\boxed{(1, 2]}", 1),
    (r"(1, 2]", r"$(1, 2]$", r"\boxed{[1, 2]}", 0),
    (r"[-2, 5)", r"$[-2, 5)$", r"\boxed{[-2,5)}", 1),
    (r"x^2+2x+1", r"$x^2+2x+1$", r"\boxed{(x+1)^2}", 1),
    (r"x^2+2x+1", r"$x^2+2x+1$", r"\boxed{x^2+1}", 0),
    (r"\frac{14}{3}", r"$\frac{14}{3}$", r"\boxed{\dfrac{14}{3}}", 1),
    # already delimited, or boxed
    (r"$\frac{1}{3}$", r"$\frac{1}{3}$", r"\boxed{1/3}", 1),
    (r"$\frac{1}{3}$", r"$\frac{1}{3}$", r"\boxed{0.3}", 0),
    (r"\boxed{5}", r"\boxed{5}", r"The answer is \boxed{5}.", 1),
    (r"\boxed{5}", r"\boxed{5}", r"\boxed{6}", 0),
    # numbers: GSM8K's answers, AIME, DAPO-Math's integer strings, a number in the row
    ("72", "$72$", r"\boxed{72}", 1),
    ("72", "$72$", r"\boxed{71}", 0),
    ("33", "$33$", r"\boxed{033}", 1),
    (204, "$204$", "Answer: 204", 1),
    ("0.5", "$0.5$", r"\boxed{\frac{1}{2}}", 1),
    ("1/2", "$1/2$", r"\boxed{0.5}", 1),
    ("1/2", "$1/2$", r"\boxed{2}", 0),
    # GSM8K's raw solution: the answer after ####
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "$72$", r"\boxed{72}", 1),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "$72$", r"\boxed{24}", 0),
]


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


def test_gold_is_delimited_the_way_math_verify_expects():
    assert delimit_gold(r"2\sqrt{3}") == r"$2\sqrt{3}$"
    assert delimit_gold(r"$\pi$") == r"$\pi$"
    assert delimit_gold(r"\boxed{5}") == r"\boxed{5}"
    assert delimit_gold(r"\(x\)") == r"\(x\)"
    assert delimit_gold("work...\n#### 1,234") == "$1,234$"
    assert delimit_gold(7) == "$7$"


@pytest.mark.slow
def test_math_reward_on_the_answers_datasets_store():
    from math_verify import parse, verify
    assert len(MATH_PAIRS) >= 30
    expected = [float(verify(parse(delimited), parse(response))) for _, delimited, response, _ in MATH_PAIRS]
    assert expected == [float(right) for *_, right in MATH_PAIRS]  # math-verify's own judgment
    with RewardWorkerPool("math", workers=2, timeout_s=30) as pool:
        futures = [pool.submit([{"answer": gold}], [response]) for gold, _, response, _ in MATH_PAIRS]
        scores = [f.result(timeout=120)[0] for f in futures]
    assert all(s.ok for s in scores), [s.error for s in scores if not s.ok]
    assert [s.reward for s in scores] == expected


@pytest.mark.slow
def test_a_pathological_gold_returns_within_the_timeout_from_a_worker():
    # sympy compares 9^(9^(9^9)) with the response in one C call with the GIL held: no signal
    # handler runs (math-verify's own timeout is on in the worker's main thread), only a kill from
    # outside ends it. A group costs two bounds (two timeouts in a row fail the rest), not G.
    with RewardWorkerPool("math", workers=1, timeout_s=3) as pool:
        pool.wait_ready()
        t0 = time.monotonic()
        [one] = pool.submit([{"answer": "9^{9^{9^{9}}}"}], [r"\boxed{1}"]).result(timeout=60)
        assert time.monotonic() - t0 < 3 + 2
        assert one.status == "timeout" and one.reward == 0.0 and "reward_timeout_s=3" in one.error
        t0 = time.monotonic()
        scores = pool.submit([{"answer": "9^{9^{9^{9}}}"}] * 8, [r"\boxed{1}"] * 8).result(timeout=60)
        assert time.monotonic() - t0 < 2 * (3 + 2)
        assert [s.status for s in scores] == ["timeout"] * 8
        assert "2 calls in a row timed out on this prompt" in scores[-1].error
        assert pool.submit([{"answer": "2"}], [r"\boxed{2}"]).result(timeout=60)[0].reward == 1.0


def test_math_reward_in_process_and_a_gold_it_cannot_parse():
    assert math_reward({"answer": "0.5"}, r"hence \boxed{\frac{1}{2}}") == 1.0
    assert get_reward("math")({"answer": r"\dfrac{3}{4}"}, r"\boxed{0.75}") == 1.0
    with pytest.raises(ValueError, match="could not parse the reference answer"):
        math_reward({"answer": ""}, r"\boxed{1}")
    with pytest.raises(RewardSpecError, match="rollout.reward='nope': expected one of math, exact_match"):
        get_reward("nope")
    with pytest.raises(RewardSpecError, match="no_such_module"):
        get_reward("no_such_module:fn")


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
