"""Multi-turn episodes: the environment the config names (rollout.environment, with
rollout.environment_args), checked at start by building one instance.

    factory = env_factory(cfg.rollout)     # record -> a fresh Environment (rollout.envs)
    env = factory(record)
"""
from __future__ import annotations

from typing import Any, Callable

from rollout.envs import EnvironmentSpecError, environment_class


def env_factory(rollout_cfg: Any) -> Callable[[dict], Any]:
    """record -> a fresh environment of rollout.environment with rollout.environment_args.
    EnvironmentSpecError (at start) names an environment that does not resolve; a TypeError from
    the arguments is raised here too, by building one instance."""
    cls = environment_class(rollout_cfg.environment)
    args = dict(rollout_cfg.environment_args)
    try:
        cls(**args)
    except TypeError as e:
        raise EnvironmentSpecError(f"rollout.environment_args={args!r} do not fit "
                                   f"{rollout_cfg.environment!r}: {e}") from None
    return lambda record: cls(**args)
