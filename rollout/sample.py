"""The `Sample` record: one response (or multi-turn episode) to one prompt, token-in/token-out.

Per-token arrays are aligned with `response_ids` (everything after the prompt):
    logprobs[t]         log pi_rollout of response_ids[t] (0.0 where loss_mask is 0: env tokens)
    loss_mask[t]        1: a model token to train on; 0: environment/tool token or a masked one
    weight_versions[t]  the SGLang weight version that produced the token ("" for env tokens)
The trainer's sequence is prompt_ids + response_ids.
"""
from __future__ import annotations

import dataclasses
from typing import Any

# status values
PENDING = "pending"    # not generated yet, or resumable (partial response in the buffer)
DONE = "done"          # finished: "stop", "length" or a multi-turn episode end
ABORTED = "aborted"    # given up (e.g. a multi-turn episode cut by an abort): never trained on


@dataclasses.dataclass
class Sample:
    group_id: int
    """All G samples of one prompt share it (GSPO's group for advantages)."""
    index: int
    """Position within the group, 0..G-1."""
    prompt: dict[str, Any]
    """The prompt record as loaded (e.g. {"prompt": ..., "answer": ...})."""
    prompt_ids: list[int]
    max_new_tokens: int
    """Total response-token budget over all segments / turns."""
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    """Last generation's reason: "stop", "length", "abort"; "budget" when a multi-turn episode ran
    out of its token budget; "env_done" when the environment ended it."""
    status: str = PENDING
    reward: float | None = None
    reward_error: str | None = None
    """repr of the exception the reward function raised (reward is then 0.0)."""
    num_segments: int = 0
    """Generate calls that contributed tokens (>1 after partial-rollout resumes or several turns)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def is_done(self) -> bool:
        return self.status == DONE

    def append_model_tokens(self, ids: list[int], logprobs: list[float], versions: list[str]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"model tokens misaligned: {len(ids)} ids, {len(logprobs)} log-probs, "
                             f"{len(versions)} versions")
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.weight_versions += versions

    def append_env_tokens(self, ids: list[int]) -> None:
        """Environment / tool tokens: in the sequence, never trained on, no log-prob."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [""] * len(ids)

    def mask_stale_tokens(self, current_version: str) -> int:
        """loss_mask 0 on model tokens from weights other than `current_version`; returns how many."""
        n = 0
        for t, v in enumerate(self.weight_versions):
            if self.loss_mask[t] and v != current_version:
                self.loss_mask[t] = 0
                n += 1
        return n

    def check_aligned(self) -> None:
        n = len(self.response_ids)
        lengths = (len(self.logprobs), len(self.loss_mask), len(self.weight_versions))
        if lengths != (n, n, n):
            raise AssertionError(f"sample {self.group_id}/{self.index}: {n} response ids but "
                                 f"(logprobs, loss_mask, weight_versions) lengths {lengths}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable if prompt/metadata are) for checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(**d)
