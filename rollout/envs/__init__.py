"""Multi-turn environments: the ones shipped with the project by name, or a user's class.

    cls = environment_class("calculator")                 # or "my_pkg.my_module:MyEnv"
    env = cls(**environment_args)                          # one instance per episode

An environment implements rollout.generation.multiturn.Environment: reset(prompt_record) -> first user
message, step(model_turn_text) -> EnvStep(observation, reward, done, tool_call). A shipped one is
an entry of ENVIRONMENTS; the first line of its class's docstring describes it in
`gspo-megatron config`.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from gspo_errors import InputError
from rollout.envs.calculator import CalculatorEnv
from rollout.envs.guessing import GuessingGameEnv

ENVIRONMENTS = {"calculator": CalculatorEnv, "guessing": GuessingGameEnv}


def environment_descriptions() -> dict[str, str]:
    """Name -> the first line of its class's docstring (its own, never a base class's)."""
    return {name: (cls.__doc__ or "").strip().split("\n")[0].rstrip(".")
            for name, cls in ENVIRONMENTS.items()}


class EnvironmentSpecError(InputError, ValueError):
    """A rollout.environment that names no usable environment class; the message names it."""


def environment_class(spec: str) -> type:
    """The class `spec` names: a shipped environment, or `package.module:ClassName`."""
    cls: Any  # a user's module attribute: checked to be an environment class below
    if spec in ENVIRONMENTS:
        cls = ENVIRONMENTS[spec]
    elif ":" in spec:
        module_name, _, name = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
            raise EnvironmentSpecError(f"rollout.environment={spec!r}: cannot import {module_name!r} "
                                       f"({type(e).__name__}: {e})") from None
        cls = getattr(module, name, None)
        if cls is None:
            raise EnvironmentSpecError(f"rollout.environment={spec!r}: module {module_name!r} has no "
                                       f"{name!r}")
    else:
        raise EnvironmentSpecError(f"rollout.environment={spec!r}: expected one of "
                                   f"{sorted(ENVIRONMENTS)} or 'package.module:ClassName'")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise EnvironmentSpecError(f"rollout.environment={spec!r}: {getattr(cls, '__name__', cls)!r} is "
                                   f"not an environment class (needs reset() and step(); "
                                   f"missing {missing or 'a class'}); see rollout.generation.multiturn.Environment")
    return cls


__all__ = ["CalculatorEnv", "ENVIRONMENTS", "EnvironmentSpecError", "GuessingGameEnv",
           "environment_class", "environment_descriptions"]
