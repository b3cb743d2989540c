"""How the rollout manager samples (rollout/generation/manager.py): groups, budgets, sampling parameters,
partial rollouts. The trainer's `rollout:` config section is this plus prompts, reward and servers.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.generation.sample import Sample


@dataclasses.dataclass
class ManagerConfig:
    """How the rollout manager samples: groups, budgets, sampling parameters, partial rollouts.
    (The trainer's `rollout:` config section is this plus prompts, reward and servers.)"""

    group_size: int = 8
    """G: responses sampled per prompt (GSPO's group)."""
    max_new_tokens: int = 64
    """Response budget per sample (all segments / turns together); a prompt record's own
    "max_new_tokens" field overrides it for that prompt."""
    temperature: float = 1.0
    """Sampling temperature; the trainer computes log-probs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off; 1 = greedy, with log-probs of the full temperature-1 softmax)."""
    max_turn_tokens: int | None = None
    """Multi-turn: cap on one model turn (null: the remaining budget)."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Extra stop tokens; the model's EOS always stops (unless ignore_eos)."""
    ignore_eos: bool = False
    """Generate to the budget through EOS (benchmarks, tests)."""
    seed: int | None = None
    """Base of a per-request SGLang `sampling_seed` derived from (seed, group id, sample index,
    tokens so far): rollouts fixed by the seed and the weights. SGLang honours it only with
    --enable-deterministic-inference (added to servers the run starts), which needs a GPU
    attention backend: on CPU (torch_native) the server refuses that flag and the seed is
    ignored (SGLang's SamplingBatchInfo.from_schedule_batch). null = unseeded sampling."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage) and draw more prompts to refill."""
    oversample_groups: int = 0
    """Groups kept in flight beyond those still needed (a faster fill; leftovers are aborted)."""
    max_draw_factor: float = 8.0
    """A step fails once it has drawn this many times the needed groups of new prompts without
    filling the batch."""
    partial_rollouts: bool = False
    """Abort unfinished samples once the batch is full and resume them next step (their
    remaining budget only)."""
    mask_stale_tokens: bool = False
    """With partial rollouts: loss-mask tokens produced by weights older than the current ones."""
    max_in_flight_requests: int = 256
    """Generation requests in flight at once (SGLang batches them)."""
    request_timeout_s: float = 600.0
    """Bound on any single wait for generation results (nothing waits forever)."""
    abort_timeout_s: float = 10.0
    """After an abort (a signal's stop, a pause for a weight sync, a step's surplus requests),
    requests that have not returned within this are abandoned (a stalled server): their samples go
    back unfinished and are generated again."""
    max_reward_error_fraction: float = 0.0
    """The run fails once more than this fraction of reward calls raised."""
    return_routed_experts: bool = False
    """MoE routing replay: record the experts SGLang routed every token to (Sample.routed_experts,
    int16 [tokens, layers, top-k]). The servers must run with --enable-return-routed-experts
    (ServerConfig.return_routed_experts). These requests bypass sglang-router (it drops the field)."""

    def generate_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of pool.generate (none unless routing replay is on)."""
        return {"return_routed_experts": True} if self.return_routed_experts else {}

    def sampling_params(self, max_new_tokens: int, sample: Sample | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k}
        if self.seed is not None and sample is not None:
            # SGLang seeds its sampler per request and position (sglang/srt/layers/sampler.py
            # Sampler._sample_from_probs)
            key = f"{self.seed}/{sample.group_id}/{sample.index}/{len(sample.response_ids)}"
            params["sampling_seed"] = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params
