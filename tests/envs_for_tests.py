"""Environments with bugs, for tests/trainer/test_trainer_multiturn.py: a user's environment class as the
config names it (rollout.environment = "tests.envs_for_tests:FlakyCalculator")."""
from __future__ import annotations

from rollout.envs import CalculatorEnv
from rollout.generation.multiturn import EnvStep


class FlakyCalculator(CalculatorEnv):
    """The calculator, except that its second turn raises (questions with an even character sum)
    or returns a malformed step, a reward that is not a number (the others)."""

    def reset(self, prompt: dict) -> str:
        self.turn, self.key = 0, sum(map(ord, prompt["prompt"]))
        return super().reset(prompt)

    def step(self, model_turn: str):
        self.turn += 1
        if self.turn >= 2 and self.key % 2 == 0:
            raise ValueError(f"calculator crashed on {model_turn[:20]!r}")
        if self.turn >= 2:
            return EnvStep("oops", "not a number", False)  # type: ignore[arg-type]
        return super().step(model_turn)
