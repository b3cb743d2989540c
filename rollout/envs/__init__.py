"""Multi-turn environments: the table of them by name, or a user's class.

    cls = environment_class("calculator")                 # or "my_pkg.my_module:MyEnv"
    env = cls(**environment_args)                          # one instance per episode

An environment implements rollout.generation.multiturn.Environment: reset(prompt_record) -> first user
message, step(model_turn_text) -> EnvStep(observation, reward, done, tool_call). A row of
ENVIRONMENTS is such a class, under its `name`; the first line of its docstring describes it in
`gspo-megatron config`; its constructor's keyword arguments are its own settings
(rollout.environment_args). One from outside the package is named `package.module:ClassName`, or
registered by a `plugins:` module (`ENVIRONMENTS.register(MyEnv)`).
"""
from __future__ import annotations

import inspect

from gspo_errors import InputError
from gspo_tables import Table, TableError
from rollout.envs.calculator import CalculatorEnv
from rollout.envs.guessing import GuessingGameEnv


def _first_line(cls: type) -> str:
    """The first line of its class's own docstring (never a base class's)."""
    return (cls.__dict__.get("__doc__") or "").strip().split("\n")[0].rstrip(".")


ENVIRONMENTS: Table[type] = Table("environment", type, (CalculatorEnv, GuessingGameEnv),
                                  field="rollout.environment", name_of=lambda cls: cls.__dict__.get("name", ""),
                                  description_of=_first_line, kind="class with reset() and step()")


class EnvironmentSpecError(InputError, ValueError):
    """A rollout.environment that names no usable environment class; the message names it."""


def environment_class(spec: str) -> type:
    """The class `spec` names: a row of ENVIRONMENTS, or `package.module:ClassName`."""
    try:
        cls = ENVIRONMENTS.row(spec, "rollout.environment")
    except TableError as e:
        raise EnvironmentSpecError(str(e)) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise EnvironmentSpecError(f"rollout.environment={spec!r}: {getattr(cls, '__name__', cls)!r} is "
                                   f"not an environment class (needs reset() and step(); "
                                   f"missing {missing or 'a class'}); see rollout.generation.multiturn.Environment")
    return cls


__all__ = ["CalculatorEnv", "ENVIRONMENTS", "EnvironmentSpecError", "GuessingGameEnv", "environment_class"]
