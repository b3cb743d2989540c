"""Multi-turn episodes in the trainer: the environment from the config, per-turn credit as
per-token advantages, scripted demonstrations for the warm start, and the rollout records.

    factory = env_factory(cfg.rollout)                 # record -> Environment (rollout.envs)
    adv = token_advantages(samples, group_size, width, discount)   # [b, s] for gspo_token
    prompt_ids, response_ids, mask = demonstration(record, factory(record), chat, tokenizer)
    RolloutRecords(path).write(step, samples, batch)   # one JSON line per sample (tests, debugging)

rollout/ runs the episodes (token-in/token-out, rollout.multiturn); this module turns them into
what the actor trains on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from gspo_megatron.actor.batch import TrainBatch
from gspo_megatron.algorithms.advantages import turn_advantages
from rollout.envs import environment_class
from rollout.sample import Sample


def env_factory(rollout_cfg: Any) -> Callable[[dict], Any]:
    """record -> a fresh environment of rollout.environment with rollout.environment_args.
    EnvironmentSpecError (at start) names an environment that does not resolve; a TypeError from
    the arguments is raised here too, by building one instance."""
    cls = environment_class(rollout_cfg.environment)
    args = dict(rollout_cfg.environment_args)
    try:
        cls(**args)
    except TypeError as e:
        from rollout.envs import EnvironmentSpecError
        raise EnvironmentSpecError(f"rollout.environment_args={args!r} do not fit "
                                   f"{rollout_cfg.environment!r}: {e}") from None
    return lambda record: cls(**args)


def token_advantages(samples: list[Sample], group_size: int, width: int | None, discount: float) -> torch.Tensor:
    """Per-token advantages from per-turn rewards (algorithms/advantages.turn_advantages): every
    token of model turn k of episode i gets A_{i,k}; prompt and environment tokens 0 (their loss
    mask is 0 anyway). Aligned like TrainBatch: [b, width] padded, column t is token t of prompt +
    response; width=None: packed, [sum of the rows' lengths], row after row."""
    per_turn = turn_advantages([s.metadata.get("turn_rewards") or [float(s.reward)] for s in samples],
                               group_size, discount)
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    out = torch.zeros(total if width is None else (len(samples), width), dtype=torch.float32)
    start = 0
    for i, (s, adv) in enumerate(zip(samples, per_turn)):
        p = len(s.prompt_ids)
        row = out[start:start + p + len(s.response_ids)] if width is None else out[i]
        start += p + len(s.response_ids)
        model_spans = [(a, b) for kind, a, b in s.metadata.get("spans", []) if kind == "model"]
        for (a, b), value in zip(model_spans, adv):
            row[p + a:p + b] = value
    return out


def demonstration(record: dict, env: Any, chat: Any, tokenizer: Any) -> tuple[list[int], list[int], list[int]]:
    """A scripted episode for the supervised warm start: record["solution"] lists the assistant's
    turns; they are played against the environment through the chat template exactly as rollouts
    are built (each turn's text + EOS, then the environment's tokens), so the warm start teaches
    the same token sequences RL will sample. Returns (prompt ids, response ids, loss mask)."""
    turns = record.get("solution")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"a multi-turn warm start needs the record's 'solution' as a list of "
                         f"assistant turns, got {turns!r:.80}")
    eos = int(tokenizer.eos_token_id)
    prompt = chat.first_prompt_ids(env.reset(record))
    response, mask = [], []
    for k, text in enumerate(turns):
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [eos]
        response += ids
        mask += [1] * len(ids)
        step = env.step(text)
        if step.done or k == len(turns) - 1:
            break
        obs = chat.observation_ids(step.observation, role=chat.role_for(step.tool_call),
                                   model_turn_closed=True)
        response += obs
        mask += [0] * len(obs)
    return prompt, response, mask


class RolloutRecords:
    """Appends one JSON line per sample and step: what was sampled and the row the actor trained on."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, samples: list[Sample], batch: TrainBatch) -> None:
        with self.path.open("a") as f:
            for row, s in enumerate(samples):
                adv = batch.row_values("advantages", row) if batch.is_token_field("advantages") \
                    else batch.advantages[row]
                f.write(json.dumps({
                    "step": step, "row": row, "group_id": s.group_id, "index": s.index,
                    "data_source": s.prompt.get("data_source"),
                    "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                    "loss_mask": s.loss_mask, "logprobs": s.logprobs,
                    "weight_versions": s.weight_versions, "reward": s.reward, "reward_error": s.reward_error,
                    "teacher_logprobs": s.teacher_logprobs,
                    "finish_reason": s.finish_reason, "metadata": s.metadata,
                    "batch_tokens": batch.row_values("tokens", row).tolist(),
                    "batch_loss_mask": batch.row_values("loss_mask", row).int().tolist(),
                    "batch_rollout_log_probs": batch.row_values("rollout_log_probs", row).tolist(),
                    "batch_advantages": adv.tolist() if adv.dim() else float(adv),
                }) + "\n")
