"""Small verifiable multi-turn environments (examples and tests)."""
from rollout.envs.calculator import CalculatorEnv
from rollout.envs.guessing import GuessingGameEnv

__all__ = ["CalculatorEnv", "GuessingGameEnv"]
