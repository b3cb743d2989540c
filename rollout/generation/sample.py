"""The `Sample` record: one response (or multi-turn episode) to one prompt, token-in/token-out.

Per-token arrays are aligned with `response_ids` (everything after the prompt):
    logprobs[t]         log pi_rollout of response_ids[t] (0.0 where loss_mask is 0: env tokens)
    loss_mask[t]        1: a model token to train on; 0: environment/tool token or a masked one
    weight_versions[t]  the SGLang weight version that produced the token ("" for env tokens)
The trainer's sequence is prompt_ids + response_ids.

Routing replay (MoE, rollout.return_routed_experts): `routed_experts` is aligned with the whole
sequence `tokens` (prompt included): int16 [len(tokens), num_hidden_layers, top-k]; row p = the
experts the engine chose at input position p in the generate call that produced token p + 1, so
a replayed route belongs to the weight version that generated the token it predicts. A later
call (a partial rollout resumed after a weight sync, the next turn of an episode) also returns
rows for the earlier positions, recomputed by its prefill: they fill only rows no earlier call
covered (the environment tokens of earlier turns). Rows the engine never processed as input are
-1: the final token (sampled, never fed) and environment tokens appended after the last model
turn. None when not requested.

What SGLang 0.5.23 returns (verified on a live CPU server, tests/rollout/test_routed_experts_replay.py;
paths under .venv/lib/python3.11/site-packages/sglang/srt/):
- `"return_routed_experts": true` in /generate -> meta_info["routed_experts"], base64 of int32
  [prompt_tokens + completion_tokens - 1, num_hidden_layers, num_experts_per_tok]: rows [0, seqlen-1)
  read by KV slot (state_capturer/base.py BaseTopkCapturer.get_topk, called from
  SchedulerBatchResultProcessor._maybe_collect_routed_experts), base64 by
  DetokenizerManager._b64_encode_per_request. Needs the server flag --enable-return-routed-experts
  (RoutedExpertsCapturer.create); without it the key is absent (the same
  _maybe_collect_routed_experts), and sglang-router 0.3.2 drops the request field
  (rollout.servers.pool then goes direct).
- Routings are stored per KV slot: each forward writes its top-k ids at the slots it wrote KV to
  (BaseTopkCapturer.on_forward_end, host buffer indexed by out_cache_loc). Prompt tokens whose KV
  came from the radix (prefix) cache get the routing computed by the forward that filled that KV,
  i.e. with the same weights (weight updates flush the cache; an update with flush_cache=False
  leaves both the KV and the routing of cached prefixes stale). Verified equal: a fresh prompt, the
  same prompt from the cache (cached_tokens = prompt - 1), a resume from prompt + output (cached),
  and a recompute after /flush_cache; the expert sets equal transformers' router top-k.
- Dense (non-MoE) layers are never captured: their rows are all 0 (the device buffer is zero-
  filled, BaseDeviceCache.__init__), like a duplicated expert 0 (GLM-4.5's first dense layer
  gives [0, 0]). Consumers must pick the MoE layers from the model config.
- Shared experts fused into the top-k are cut off (RoutedExpertsCapturer._get_local_slice).
- An aborted request that had started returns rows for everything it processed.
- A request SGLang retracts (a pause in "retract" mode, a decode batch out of KV cache) loses its
  slots and is prefilled again, perhaps under new weights, which writes that prefill's routes at
  every position; the project's servers keep the released rows and return them instead
  (rollout/in_server/released_routes.py), so a route is still the one of the pass that sampled the
  next token. Aborted while it waits in the queue, such a request returns no routes at all: its
  tokens are dropped and generated again (rollout/generation/requests.py).
The check that a sample's records are paired: rollout/generation/alignment.py.
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

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
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: log pi_teacher of each response token (rollout/generation/teacher.py), aligned
    with response_ids (environment tokens included; the trainer uses loss_mask tokens only)."""
    routed_experts: np.ndarray | None = None
    """int16 [len(tokens), num_hidden_layers, top-k]: the engine's routing of each input position
    in the last generate call, -1 where there is none (module docstring); None: not requested."""

    @property
    def score(self) -> float:
        """The reward of a scored sample (what the driver trains on and evaluates; every sample it
        receives has been scored)."""
        if self.reward is None:
            raise ValueError(f"sample {self.index} of group {self.group_id} has no reward yet")
        return self.reward

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def restart(self) -> None:
        """Back to its prompt: the response, its per-token arrays, routes, reward and teacher
        log-probs dropped (an episode cut by a stop, a partial response too stale to resume)."""
        self.response_ids, self.logprobs, self.loss_mask, self.weight_versions = [], [], [], []
        self.num_segments, self.status, self.finish_reason = 0, PENDING, None
        self.reward, self.routed_experts, self.teacher_logprobs = None, None, None

    def append_model_tokens(self, ids: list[int], logprobs: list[float], versions: list[str],
                            routed_experts: np.ndarray | None = None) -> None:
        """routed_experts: the generate call's routing, [len(tokens) - 1, layers, k] counted after
        the append (its input was the whole sequence so far); it replaces the stored one."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"model tokens misaligned: {len(ids)} ids, {len(logprobs)} log-probs, "
                             f"{len(versions)} versions")
        rows = len(self.prompt_ids) + len(self.response_ids) + len(ids) - 1
        if routed_experts is not None and (routed_experts.ndim != 3 or len(routed_experts) != rows):
            raise ValueError(f"routed experts of shape {tuple(routed_experts.shape)} for a sequence of "
                             f"{rows + 1} tokens: expected [{rows}, layers, top-k]")
        earlier = self.routed_experts
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.weight_versions += versions
        if routed_experts is not None:
            routed = routed_experts.astype(np.int16, copy=True)
            if earlier is not None:  # rows an earlier call produced stay (the module docstring)
                n = min(len(earlier), len(routed))
                covered = (earlier[:n] >= 0).any(axis=(1, 2))
                routed[:n][covered] = earlier[:n][covered]
            self.routed_experts = routed
        self._pad_routed_experts()

    def append_env_tokens(self, ids: list[int]) -> None:
        """Environment / tool tokens: in the sequence, never trained on, no log-prob."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [""] * len(ids)
        self._pad_routed_experts()

    def _pad_routed_experts(self) -> None:
        """-1 rows for the positions without a routing, up to len(tokens)."""
        r = self.routed_experts
        n = len(self.prompt_ids) + len(self.response_ids)
        if r is not None and len(r) < n:
            self.routed_experts = np.concatenate([r, np.full((n - len(r),) + r.shape[1:], -1, r.dtype)])

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
        if self.routed_experts is not None and len(self.routed_experts) != len(self.prompt_ids) + n:
            raise AssertionError(f"sample {self.group_id}/{self.index}: {len(self.prompt_ids) + n} "
                                 f"tokens but {len(self.routed_experts)} routed-experts rows")

    def __eq__(self, other: Any) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        a, b = self.routed_experts, other.routed_experts
        same_routing = (a is None and b is None) or (
            a is not None and b is not None and a.shape == b.shape and bool(np.array_equal(a, b)))
        return same_routing and all(getattr(self, f.name) == getattr(other, f.name)
                                    for f in dataclasses.fields(self) if f.name != "routed_experts")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable if prompt/metadata are) for checkpoints; routed_experts
        as {"shape": [...], "int16_base64": little-endian bytes} (a partial sample in the rollout
        buffer keeps its routing: a resume that finds no budget left generates nothing more)."""
        r = self.routed_experts
        d = dataclasses.asdict(dataclasses.replace(self, routed_experts=None))
        if r is not None:
            d["routed_experts"] = {"shape": list(r.shape), "int16_base64": base64.b64encode(
                np.ascontiguousarray(r, dtype="<i2").tobytes()).decode("ascii")}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = dict(d)
        r = d.pop("routed_experts", None)  # absent in checkpoints written before routing replay
        if isinstance(r, dict):
            r = np.frombuffer(base64.b64decode(r["int16_base64"]), dtype="<i2").reshape(r["shape"])
        return cls(**d, routed_experts=None if r is None else np.array(r, dtype=np.int16))
