"""Rollout records (logging.rollout_records): one JSON line per sample and step, with what was
sampled and the row the actor trained on (tests and debugging read them).

    RolloutRecords(path).write(step, samples, batch)
"""
from __future__ import annotations

import json
from pathlib import Path

from gspo_megatron.actor.batching.batch import TrainBatch
from rollout.generation.sample import Sample


class RolloutRecords:
    """Appends one JSON line per sample and step: what was sampled and the row the actor trained on.
    `batch_advantages` is null where the driver does not know them: with the KL in the reward
    (loss.kl_in_reward_coef > 0) they are computed on the last pipeline stage from the reference
    log-probs (actor/reward_kl.py), and the driver's batch holds only placeholders."""

    def __init__(self, path: str | Path, advantages_on_last_stage: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.advantages_known = not advantages_on_last_stage

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
                    "batch_advantages": (adv.tolist() if adv.dim() else float(adv)) if self.advantages_known else None,
                }) + "\n")
