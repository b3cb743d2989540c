"""Rollouts from SGLang servers, zoned by what each part talks to:

- servers/     the SGLang processes: launch, memory, health, the HTTP client and the pool;
- generation/  the step's rollouts: groups, dynamic sampling, partial rollouts, multi-turn
               episodes, asynchronous rollouts, the distillation teacher;
- prompts/     prompt sets and the resumable prompt stream;
- rewards/     the table of rewards, the worker processes, the code sandbox, the HTTP service;
- envs/        multi-turn environments;
- in_server/   what runs inside the SGLang process (the weight loader, CPU stand-ins).

Knows nothing of megatron, model_specs or gspo_megatron; its errors derive from gspo_errors."""
