"""Multi-turn episodes: what an environment is and how an episode runs token-in/token-out
(episode.py), and the episode's turns through the tokenizer's chat template (chat.py).

    from rollout.generation.multiturn import Environment, EnvStep, run_episode
"""
from rollout.generation.multiturn.episode import (ChatFormat, Environment, EnvironmentFault, EnvStep, EpisodeChat,
                                                  FormatChat, run_episode)

__all__ = ["ChatFormat", "EnvStep", "Environment", "EnvironmentFault", "EpisodeChat", "FormatChat", "run_episode"]
