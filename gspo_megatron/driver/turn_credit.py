"""Multi-turn per-turn credit (rollout.turn_credit: return_to_go): each token of model turn k
gets the episode's advantage of turn k, for gspo_token (docs/algorithm.md).

    adv = turn_credit_advantages(samples, group_size, width=None, discount=0.9)   # [T] packed

rollout/ runs the episodes (token-in/token-out, rollout.generation.multiturn); this turns their per-turn
rewards into what the actor trains on. Not TrainBatch.token_advantages, which only spreads a
batch's advantages (per row or per token) over its tokens.
"""
from __future__ import annotations

import torch

from gspo_megatron.algorithms.advantages import turn_advantages
from rollout.generation.sample import Sample


def turn_credit_advantages(samples: list[Sample], group_size: int, width: int | None, discount: float) -> torch.Tensor:
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
