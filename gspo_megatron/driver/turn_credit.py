"""Multi-turn per-turn credit (rollout.turn_credit: return_to_go): each token of model turn k
gets an advantage from the rewards of turn k on, for gspo_token (docs/algorithm.md).

    scores, turn_returns, turn_rewards = turn_credit_inputs(samples, discount=0.9)   # [n], [T], [T]
    adv = turn_credit_advantages(samples, group_size, width=None, discount=0.9)      # [T] packed

With G_{i,k} = sum_{m >= k} discount^(m - k) r_{i,m} (the turn rewards of episode i): a group
estimator (ESTIMATORS' kind "group") scores episode i by G_{i,1} and gives each token of turn k
(G_{i,k} - b_i) / d_i with its group's baseline and scale (algorithms/advantage); a return
estimator sees each turn's reward on the turn's last token and takes the return-to-go per token.
rollout/ runs the episodes (token-in/token-out, rollout.generation.multiturn); this turns their
per-turn rewards into what the estimators read. Not TrainBatch.token_advantages, which only
spreads a batch's advantages (per row or per token) over its tokens.
"""
from __future__ import annotations

import torch

from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from rollout.generation.sample import Sample


def _turn_rewards(s: Sample) -> list[float]:
    return [float(x) for x in (s.metadata.get("turn_rewards") or [s.score])]


def turn_credit_inputs(samples: list[Sample], discount: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores [n]: each episode's G_{i,1}; turn_returns [T]: G_{i,k} on every token of model turn
    k; turn_rewards [T]: r_{i,k} on the last token of model turn k), packed row after row like
    TrainBatch (column t of a row is token t of prompt + response), float64; prompt and
    environment tokens 0 (their loss mask is 0 anyway)."""
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    returns = torch.zeros(total, dtype=torch.float64)
    rewards = torch.zeros(total, dtype=torch.float64)
    scores = torch.zeros(len(samples), dtype=torch.float64)
    start = 0
    for i, s in enumerate(samples):
        r = _turn_rewards(s)
        g, acc = [0.0] * len(r), 0.0
        for k in range(len(r) - 1, -1, -1):
            acc = r[k] + discount * acc
            g[k] = acc
        scores[i] = g[0] if g else 0.0
        p = start + len(s.prompt_ids)
        spans = [(a, b) for kind, a, b in s.metadata.get("spans", []) if kind == "model"]
        for (a, b), value, reward in zip(spans, g, r):
            returns[p + a:p + b] = value
            if b > a:
                rewards[p + b - 1] = reward
        start += len(s.prompt_ids) + len(s.response_ids)
    return scores, returns, rewards


def turn_batch_advantages(settings: AdvantageSettings, samples: list[Sample], rows: BatchRows,
                          discount: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The packed per-token advantages ([T], float32) of `samples` laid out as `rows`, and the
    pipeline's metrics: a group estimator reads the episodes' scores and turn returns, a return
    estimator the turn rewards on the turns' last tokens (module docstring)."""
    scores, turn_returns, turn_rewards = turn_credit_inputs(samples, discount)
    if settings.estimator.kind == "group":
        return batch_advantages(settings, scores, rows, turn_returns=turn_returns)
    return batch_advantages(settings, scores, rows, token_rewards=turn_rewards)


def turn_credit_advantages(samples: list[Sample], group_size: int, width: int | None, discount: float,
                           settings: AdvantageSettings | None = None) -> torch.Tensor:
    """Per-token advantages from per-turn rewards under `settings`' estimator (default: grpo,
    (G_{i,k} - mean_j G_{j,1}) / (std_j G_{j,1} + 1e-6) over the episodes j of i's group), 0 off
    the trained tokens. Aligned like TrainBatch: [b, width] padded, column t is token t of prompt +
    response; width=None: packed, [sum of the rows' lengths]."""
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    mask = torch.cat([torch.tensor([0] * len(s.prompt_ids) + list(s.loss_mask), dtype=torch.bool)
                      for s in samples]) if samples else torch.zeros(0, dtype=torch.bool)
    rows = BatchRows(lengths, mask, torch.arange(len(samples)) // group_size, len(samples) // group_size)
    adv, _ = turn_batch_advantages(settings or AdvantageSettings(), samples, rows, discount)
    adv = torch.where(mask, adv, 0.0).float()
    if width is None:
        return adv
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, row in enumerate(adv.split(lengths.tolist())):
        out[i, :row.numel()] = row
    return out
