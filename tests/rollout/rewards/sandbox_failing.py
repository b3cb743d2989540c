"""A code reward whose sandbox stops starting after its probe, for test_sandbox_failure.py's
reward workers (`rollout.reward: sandbox_failing:score`): its interpreter is gone, as after an
upgrade under a running job. A real failure of the sandbox's set-up, not a stand-in."""
from __future__ import annotations

from rollout.rewards.code_reward import CodeReward
from rollout.rewards.settings import CodeSandboxSettings

_reward = CodeReward(CodeSandboxSettings(isolation="namespaces", time_limit_s=2.0))
_reward.sandbox.probe()
_reward.sandbox.python = "/nonexistent/python3"


def score(record: dict, response_text: str) -> float:
    return _reward.score(record, response_text)
