"""What a failure of the code sandbox itself costs (rollout/rewards/sandbox/run.py, scoring.py):
a run whose set-up fails is started again; one that keeps failing is the sandbox's failure, counted
and said, never a reward error of the response, which under the default
max_reward_error_fraction 0 ended the run (a response that spent the host's BPF JIT budget made
every concurrent run's seccomp filter fail to install: "the code sandbox failed to start ...
[Errno 524]")."""
from __future__ import annotations

import json

import pytest

from rollout.rewards import RewardWorkerPool
from rollout.rewards.scoring import SANDBOX, SANDBOX_FAILURES_IN_A_ROW, RewardErrorBudget, RewardErrorBudgetExceeded

ROW = {"answer": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.mark.slow
def test_a_sandbox_that_fails_to_start_is_not_the_responses_reward_error():
    said = []
    budget = RewardErrorBudget(0.0, log=said.append)  # the default: the first reward error ends the run
    with RewardWorkerPool("sandbox_failing:score", workers=1, timeout_s=30) as pool:
        scores = pool.submit([ROW] * 2, [RIGHT, RIGHT]).result(timeout=60)
    for score in scores:
        assert (score.reward, score.status) == (0.0, SANDBOX), score
        assert "failed to start a run (not the response's doing)" in score.error
        budget.record(score.ok, score.error, score.status)  # no RewardErrorBudgetExceeded
    assert (budget.errors, budget.sandbox_failures) == (0, 2)
    assert len(said) == 1 and said[0].startswith("code sandbox failure, the first of this run")


def test_a_sandbox_that_no_longer_starts_stops_the_run_in_one_line():
    # a response's run cannot make the sandbox fail for the runs after it; a machine where it no
    # longer starts at all ends the run, naming the sandbox, once no call was judged for a while
    budget = RewardErrorBudget(0.0, log=lambda line: None)
    for _ in range(SANDBOX_FAILURES_IN_A_ROW - 1):
        budget.record(False, "the code sandbox failed to start a run", SANDBOX)
    budget.record(True)  # one judged call between: the count starts again
    for _ in range(SANDBOX_FAILURES_IN_A_ROW - 1):
        budget.record(False, "the code sandbox failed to start a run", SANDBOX)
    with pytest.raises(RewardErrorBudgetExceeded, match=f"^the code sandbox failed to start "
                                                        f"{SANDBOX_FAILURES_IN_A_ROW} runs in a row"):
        budget.record(False, "the code sandbox failed to start a run", SANDBOX)
    assert budget.errors == 0 and budget.calls == 1
