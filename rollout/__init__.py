"""Rollouts from SGLang servers: server lifecycle (server), HTTP client (client), rollout manager
with group sampling, dynamic sampling and partial rollouts (manager, sample), multi-turn episodes
(multiturn, envs), rewards, and prompt datasets. Knows nothing of megatron."""
