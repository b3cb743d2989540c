"""What scores the rollouts, as the config names it: multi-turn, the environment
(rollout.environment, with rollout.environment_args), checked at start by building one instance;
single-turn, the reward worker processes (rollout.reward, rollout.reward_workers, ...).

    factory = env_factory(cfg.rollout)     # record -> a fresh Environment (rollout.envs)
    env = factory(record)
    rewards = reward_workers(cfg.rollout)  # rollout.rewards.RewardWorkerPool, its workers starting
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from gspo_megatron.config import RolloutConfig
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


def reward_workers(rollout_cfg: RolloutConfig, name: str | None = None) -> RewardWorkerPool:
    """rollout.reward_workers processes scoring `name` (default rollout.reward), with the rollout
    section's timeout and the shipped rewards' settings."""
    options = {"code_sandbox": dataclasses.asdict(rollout_cfg.code_sandbox),
               "reward_service": dataclasses.asdict(rollout_cfg.reward_service)}
    return RewardWorkerPool(name or rollout_cfg.reward, workers=rollout_cfg.reward_workers,
                            timeout_s=rollout_cfg.reward_timeout_s, options=options)
