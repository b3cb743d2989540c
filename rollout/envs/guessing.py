"""Multi-turn guessing game: find a secret integer in [low, high] with higher/lower hints.

Prompt record: {"prompt": ..., "answer": "37", "low": 1, "high": 100} ("low"/"high" optional).
The model's last integer in a turn is its guess; the observation says "higher", "lower" or
"invalid". Reward 1.0 when found (done), else 0 (episode ends after max_turns).
"""
from __future__ import annotations

import re

from rollout.generation.multiturn import Environment, EnvStep

_INT = re.compile(r"-?\d+")


class GuessingGameEnv(Environment):
    """Find a secret integer in [low, high] with higher/lower hints."""
    name = "guessing"

    def __init__(self, max_turns: int = 6):
        self.max_turns = max_turns
        self.secret, self.low, self.high = 0, 1, 100

    def reset(self, prompt: dict) -> str:
        self.secret = int(prompt["answer"])
        self.low, self.high = int(prompt.get("low", 1)), int(prompt.get("high", 100))
        return (prompt.get("prompt") or
                f"I am thinking of an integer between {self.low} and {self.high}. Guess it; "
                "I will say higher or lower.")

    def step(self, model_turn: str) -> EnvStep:
        numbers = _INT.findall(model_turn)
        if not numbers:
            return EnvStep("invalid: say one integer", 0.0, False)
        guess = int(numbers[-1])
        if guess == self.secret:
            return EnvStep("correct", 1.0, True)
        return EnvStep("higher" if guess < self.secret else "lower", 0.0, False)
