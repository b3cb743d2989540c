"""What scores the rollouts, as the config names it: multi-turn, the environment
(rollout.environment, with rollout.environment_args), checked at start by building one instance;
single-turn, the reward worker processes (rollout.reward, rollout.reward_workers, ...).

    factory = env_factory(cfg.rollout)     # record -> a fresh Environment (rollout.envs)
    env = factory(record)
    rewards = reward_workers(cfg)          # rollout.rewards.RewardWorkerPool, its workers starting
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from gspo_megatron.config import RolloutConfig, RunConfig
from rollout.envs import EnvironmentSpecError, environment_class
from rollout.generation.multiturn import Environment
from rollout.rewards import RewardWorkerPool


def env_factory(rollout_cfg: RolloutConfig) -> Callable[[dict], Environment]:
    """record -> a fresh environment of rollout.environment with rollout.environment_args.
    EnvironmentSpecError (at start) names an environment that does not resolve; a TypeError from
    the arguments is raised here too, by building one instance."""
    if rollout_cfg.environment is None:
        raise EnvironmentSpecError("rollout.environment: no environment named")
    cls = environment_class(rollout_cfg.environment)
    args = dict(rollout_cfg.environment_args)
    try:
        cls(**args)
    except TypeError as e:
        raise EnvironmentSpecError(f"rollout.environment_args={args!r} do not fit "
                                   f"{rollout_cfg.environment!r}: {e}") from None
    return lambda record: cls(**args)


def reward_workers(cfg: RunConfig, name: str | None = None, args: Mapping[str, Any] | None = None) -> RewardWorkerPool:
    """rollout.reward_workers processes scoring `name` with its own settings `args` (default
    rollout.reward with rollout.reward_args), under the rollout section's timeout; each worker
    imports the run's plug-ins first (`plugins`: a reward they register)."""
    r = cfg.rollout
    return RewardWorkerPool(name or r.reward, workers=r.reward_workers, timeout_s=r.reward_timeout_s,
                            args=r.reward_args if name is None else args, plugins=cfg.plugins)
