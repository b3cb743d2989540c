"""Rollout manager: G samples per prompt from SGLang, dynamic sampling, partial rollouts.

    manager = RolloutManager(pool, ManagerConfig(group_size=8, max_new_tokens=512),
                             encode_prompt=lambda rec: chat_prompt_ids(tok, rec),
                             decode=tok.decode, scorer=RewardWorkerPool("math", workers=8, timeout_s=60))
    result = manager.generate_step(prompt_iter, num_groups=32)   # -> result.groups, result.metrics
    state = manager.to_state()      # the buffer of unfinished groups, for the trainer's checkpoint

One HTTP request per sample (segment), up to `max_in_flight_requests` at once; SGLang batches them.
Partial rollouts (paper-independent, as in slime/Kimi): once `num_groups` groups are complete the
rest are aborted, and their partial responses wait in the buffer; next step they resume from
prompt + partial response asking only for the REMAINING budget. Every token keeps the weight version
that produced it; `mask_stale_tokens` zeroes the loss mask of tokens from older weights.
Multi-turn episodes (an `env_factory`) run to completion and are never buffered: an episode cut
by the end-of-step abort is discarded (counted in metrics).

Rewards: a group whose responses are all done goes to the scorer (rollout/rewards: worker processes
with a hard time bound per call) and is closed when its scores come back; this thread only hands
groups over and waits on generation and scoring together, so scoring overlaps generation. A group
still being scored when the step stops, or is full, waits in the buffer and is scored again.
Multi-turn environments give their rewards during the episode (their own path).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

from rollout.client_errors import NoServerLeft
from rollout.drain import drain
from rollout.manager_config import ManagerConfig
from rollout.pool import ServerPool
from rollout.rewards.answers import RewardFn
from rollout.rewards.scoring import DIED, TIMEOUT, RewardErrorBudget, Score, Scorer, ThreadScorer
from rollout.sample import ABORTED, DONE, PENDING, Sample
from rollout.step_metrics import step_metrics


class RolloutInterrupted(Exception):
    """generate_step stopped because `should_stop` said so (a graceful stop of the run)."""


@dataclasses.dataclass
class StepResult:
    groups: list[list[Sample]]
    """num_groups complete groups of group_size samples each, rewards set."""
    metrics: dict[str, float]


class RolloutManager:
    def __init__(self, pool: ServerPool, config: ManagerConfig, *,
                 encode_prompt: Callable[[dict], list[int]] | None = None, decode: Callable[[list[int]], str],
                 reward_fn: RewardFn | None = None, scorer: Scorer | None = None,
                 env_factory: Callable[[dict], Any] | None = None,
                 encode_text: Callable[[str], list[int]] | None = None, chat: Any = None,
                 max_turns: int | None = None, reward_budget: RewardErrorBudget | None = None,
                 teacher: Any = None):
        """encode_prompt: prompt record -> prompt token ids (e.g. dataset.chat_prompt_ids).
        decode: token ids -> text, for reward functions and environments (never re-encoded).
        scorer: scores single-turn groups (rollout.rewards.RewardWorkerPool: processes, a hard
        time bound per call; not closed by this manager); or reward_fn: (record, response_text) ->
        float, an in-process callable scored on a thread of its own (ThreadScorer: no time bound).
        reward_budget: the run's reward error accounting, when shared (eval and training).
        teacher: on-policy distillation (rollout.teacher.TeacherScorer): a group also waits for its
        teacher log-probs, requested beside its rewards.
        env_factory: record -> Environment, for multi-turn episodes (rollout.multiturn), whose turns
        go through `chat` (rollout.chat.ChatTemplate: the tokenizer's template) or, without it,
        fixed ChatML markers tokenised with `encode_text` (its reset() message is the prompt, so
        encode_prompt is then unused). max_turns: bound on an episode's model turns (None: the
        environment's own)."""
        if env_factory is None and reward_fn is None and scorer is None:
            raise ValueError("RolloutManager needs a scorer or reward_fn (single-turn) or an env_factory")
        if env_factory is None and encode_prompt is None:
            raise ValueError("single-turn rollouts need encode_prompt")
        if env_factory is not None and encode_text is None and chat is None:
            raise ValueError("multi-turn (env_factory) needs a chat template (or encode_text)")
        self.pool, self.config = pool, config
        self.encode_prompt, self.decode = encode_prompt, decode
        self.env_factory, self.encode_text = env_factory, encode_text
        self._own_scorer = ThreadScorer(reward_fn) if scorer is None and reward_fn is not None else None
        self.scorer = scorer or self._own_scorer
        self.chat, self.max_turns, self.teacher = chat, max_turns, teacher
        self.buffer: collections.deque[list[Sample]] = collections.deque()
        self.ready: collections.deque[list[Sample]] = collections.deque()
        """Complete, scored groups a stopped step kept (generate_step(keep_on_stop=True)): the
        next step takes them first, as they are."""
        self.next_group_id = 0
        self.reward_budget = reward_budget or RewardErrorBudget(config.max_reward_error_fraction)
        self._run_tag = uuid.uuid4().hex[:8]
        self._rid_counter = itertools.count()
        self._abandon = threading.Event()  # set: the drain stops waiting for what is in flight
        self._executor = ThreadPoolExecutor(max_workers=config.max_in_flight_requests,
                                            thread_name_prefix="rollout")

    # --- one unit of work (runs in a worker thread) ------------------------------------------
    def _run_sample(self, sample: Sample) -> Sample:
        if self.env_factory is not None:
            from rollout.multiturn import run_episode
            try:
                env = self.env_factory(sample.prompt)
            except Exception as e:  # noqa: BLE001 - a broken environment is recorded and counted
                sample.prompt_ids, sample.reward, sample.status = sample.prompt_ids or [0], 0.0, DONE
                sample.finish_reason, sample.metadata["env_error"] = "env_error", f"{type(e).__name__}: {e}"
                return sample
            return run_episode(sample, env, self.pool, self.config, self.decode, self.encode_text,
                               self._new_rid, chat=self.chat, max_turns=self.max_turns,
                               abandon=self._abandon)
        return self._generate_segment(sample)

    def _new_rid(self, sample: Sample) -> str:
        return f"{self._run_tag}-{sample.group_id}-{sample.index}-{next(self._rid_counter)}"

    def _generate_segment(self, sample: Sample) -> Sample:
        """Generate (the rest of) one single-turn response: prompt + partial -> remaining budget."""
        if sample.remaining_tokens > 0:
            out = self.pool.generate(sample.tokens, self.config.sampling_params(sample.remaining_tokens, sample),
                                     rid=self._new_rid(sample), timeout_s=self.config.request_timeout_s,
                                     abandon=self._abandon, **self.config.generate_kwargs())
            sample.append_model_tokens(out.output_ids, out.logprobs, out.weight_versions,
                                       out.routed_experts)
            sample.num_segments += 1 if out.output_ids else 0
            sample.finish_reason = out.finish_reason
        if sample.remaining_tokens <= 0 and sample.finish_reason != "stop":
            sample.finish_reason = "length"
        sample.status = PENDING if sample.finish_reason == "abort" else DONE
        return sample

    # --- a step ------------------------------------------------------------------------------
    def _new_group(self, record: dict) -> list[Sample]:
        prompt_ids = [] if self.env_factory is not None else list(self.encode_prompt(record))
        gid = self.next_group_id
        self.next_group_id += 1
        budget = int(record.get("max_new_tokens", self.config.max_new_tokens))
        return [Sample(gid, i, record, list(prompt_ids), budget)
                for i in range(self.config.group_size)]

    def generate_step(self, prompts: Iterator[dict], num_groups: int,
                      current_weight_version: str | None = None,
                      should_stop: Callable[[], bool] | None = None,
                      keep_on_stop: bool = False) -> StepResult:
        """Return `num_groups` complete groups: ready and buffered groups first, then new prompts
        from `prompts` (consumed lazily; over-sampling draws more). current_weight_version: the
        policy's version for mask_stale_tokens (default: the newest version seen in each sample).
        should_stop: polled every 0.2 s; when it says True the in-flight requests are aborted and
        RolloutInterrupted is raised. No server left in service (rollout/health.py): the same stop,
        then NoServerLeft. keep_on_stop: nothing of the step is lost then: its complete
        groups go to `ready`, its unfinished ones (partial responses, their tokens' versions kept)
        to the front of the buffer, in group order; without it the caller restores a saved state."""
        cfg = self.config
        t0 = last_done = time.monotonic()
        poll = cfg.request_timeout_s if should_stop is None else min(0.2, cfg.request_timeout_s)
        kept: list[list[Sample]] = []
        while self.ready and len(kept) < num_groups:
            kept.append(self.ready.popleft())
        open_groups: dict[int, list[Sample]] = {}
        in_flight: dict[Future, Sample] = {}
        scoring: dict[Future, tuple[list[Sample], list[Sample]]] = {}  # -> (group, its unscored samples)
        teaching: dict[Future, list[Sample]] = {}  # teacher log-probs (distillation) -> the group
        waits: dict[int, int] = {}  # group id -> answers (scores, teacher log-probs) still to come
        m = collections.Counter()
        max_draws = math.ceil(num_groups * cfg.max_draw_factor)

        def submit(sample: Sample) -> None:
            in_flight[self._executor.submit(self._run_sample, sample)] = sample

        def finish_group(group: list[Sample]) -> None:
            """Every response of the group is done: score it (and ask the teacher), or close it."""
            gid = group[0].group_id
            if gid in waits:  # its samples finished together: asked already
                return
            for s in group:
                s.check_aligned()
            waits[gid] = 0
            unscored = [s for s in group if s.reward is None]
            if unscored and self.env_factory is None:
                future = self.scorer.submit([s.prompt for s in unscored],
                                            [self.decode(s.response_ids) for s in unscored])
                scoring[future] = (group, unscored)
                waits[gid] += 1
            if self.teacher is not None and any(s.teacher_logprobs is None for s in group):
                teaching[self.teacher.submit(group)] = group
                waits[gid] += 1
            if not waits[gid]:
                close_group(group)

        def answered(group: list[Sample]) -> None:
            waits[group[0].group_id] -= 1
            if not waits[group[0].group_id]:
                close_group(group)

        def apply_teacher(group: list[Sample], results: list[tuple[list[float], float]]) -> None:
            for s, (lps, seconds) in zip(group, results):
                s.teacher_logprobs = lps
                m["teacher_seconds"] += seconds
                m["teacher_tokens"] += len(lps)
            answered(group)

        def apply_scores(group: list[Sample], unscored: list[Sample], scores: list[Score]) -> None:
            for s, score in zip(unscored, scores):
                s.reward, s.reward_error = score.reward, score.error
                s.metadata["reward_seconds"] = score.seconds
                m["reward_errors"] += not score.ok
                m["reward_timeouts"] += score.status == TIMEOUT
                m["reward_worker_restarts"] += score.status in (TIMEOUT, DIED)
                m["reward_seconds"] += score.seconds
                self.reward_budget.record(score.ok, score.error)
            answered(group)

        def close_group(group: list[Sample]) -> None:
            del open_groups[group[0].group_id]
            waits.pop(group[0].group_id, None)
            for s in group:
                if self.env_factory is not None:  # an episode's reward came from its environment
                    error = s.metadata.get("env_error")
                    m["env_errors"] += error is not None
                    self.reward_budget.record(error is None, error)
                if cfg.mask_stale_tokens:
                    versions = [v for v in s.weight_versions if v]
                    newest = current_weight_version or (versions[-1] if versions else "")
                    m["stale_tokens_masked"] += s.mask_stale_tokens(newest)
            if cfg.dynamic_sampling and len({s.reward for s in group}) == 1:
                m["groups_dropped_equal_reward"] += 1
            elif len(kept) < num_groups:
                kept.append(group)
            else:  # finished in the same instant as the last needed group: keep for next step
                self.buffer.appendleft(group)
                m["groups_completed_buffered"] += 1

        def start_group(group: list[Sample]) -> None:
            open_groups[group[0].group_id] = group
            for s in group:
                if s.status == ABORTED:  # an episode cut by a stop: it restarts
                    self._reset(s)
                elif s.status != DONE and self._routes_of_another_version(s, current_weight_version):
                    # Routing replay: a response resumed under new weights would have its prefix
                    # routed by them (SGLang recomputes it), while its earlier tokens' pi_old needs
                    # the old routes of the same positions; one routing per token cannot hold
                    # both, so the partial restarts from its prompt (tests/test_async_rl.py).
                    self._reset(s)
                    m["samples_restarted_routing"] += 1
                if s.status != DONE:
                    m["samples_resumed"] += bool(s.response_ids)
                    submit(s)
            if all(s.status == DONE for s in group):
                finish_group(group)

        interrupted, lost = False, None
        try:
            while len(kept) < num_groups and lost is None:
                while len(kept) + len(open_groups) < num_groups + cfg.oversample_groups:
                    if self.buffer:
                        start_group(self.buffer.popleft())
                        m["groups_from_buffer"] += 1
                        continue
                    record = next(prompts, None) if m["prompts_drawn"] < max_draws else None
                    if record is None:
                        break
                    m["prompts_drawn"] += 1
                    start_group(self._new_group(record))
                if len(kept) >= num_groups:
                    break
                if not in_flight and not scoring and not teaching:
                    raise RuntimeError(
                        f"rollout step cannot fill {num_groups} groups: {len(kept)} kept, "
                        f"{m['groups_dropped_equal_reward']} dropped (all rewards equal), "
                        f"{m['prompts_drawn']} prompts drawn (limit {max_draws} = max_draw_factor "
                        f"{cfg.max_draw_factor} x {num_groups}), or the prompt iterator ran out")
                if should_stop is not None and should_stop():
                    interrupted = True
                    break
                only_scoring, waited = not in_flight, time.monotonic()
                done, _ = wait([*in_flight, *scoring, *teaching], timeout=poll, return_when=FIRST_COMPLETED)
                if only_scoring:  # what scoring costs this thread: waiting with nothing generating
                    m["reward_wait_seconds"] += time.monotonic() - waited
                if not done:
                    # scoring is bounded by the scorer (reward_timeout_s per call); this bounds generation
                    if time.monotonic() - last_done < cfg.request_timeout_s or not in_flight:
                        continue
                    raise TimeoutError(f"no rollout request finished within {cfg.request_timeout_s} s "
                                       f"({len(in_flight)} in flight)")
                last_done = time.monotonic()
                for f in done:
                    if f in scoring:
                        group, unscored = scoring.pop(f)
                        apply_scores(group, unscored, f.result())  # RewardWorkerError propagates
                        continue
                    if f in teaching:
                        apply_teacher(teaching.pop(f), f.result())  # a lost teacher server propagates
                        continue
                    sample = in_flight.pop(f)
                    try:
                        f.result()  # a server failure propagates here
                    except NoServerLeft as e:  # the step stops as at a signal (keep_on_stop: nothing lost)
                        lost = e
                        if self.env_factory is not None:
                            sample.status = ABORTED  # an episode restarts from its prompt
                        break
                    if sample.status != DONE:  # aborted by someone else before we were full: resume
                        if sample.status == ABORTED:
                            self._reset(sample)
                        submit(sample)
                        continue
                    # several samples of a group can finish together: the first one closes it
                    group = open_groups.get(sample.group_id)
                    if group is not None and all(s.status == DONE for s in group):
                        finish_group(group)
        finally:
            drain(self.pool, in_flight, min(self.config.abort_timeout_s, self.config.request_timeout_s),
                  self._abandon)
        if interrupted or lost is not None:
            message = f"rollout interrupted with {len(kept)} of {num_groups} groups complete"
            if keep_on_stop:
                self.ready.extendleft(reversed(kept))
                self.buffer.extendleft(sorted(open_groups.values(), key=lambda g: -g[0].group_id))
            if lost is not None:
                raise lost
            raise RolloutInterrupted(message)
        for group in sorted(open_groups.values(), key=lambda g: g[0].group_id):
            if all(s.status == DONE for s in group):
                self.buffer.append(group)
                m["groups_completed_buffered"] += 1
            elif cfg.partial_rollouts and self.env_factory is None:
                self.buffer.append(group)
                m["groups_partial_buffered"] += 1
            else:
                m["groups_discarded"] += 1
        return StepResult(kept, self._metrics(kept, m, time.monotonic() - t0))

    def _routes_of_another_version(self, sample: Sample, current: str | None) -> bool:
        """A partial response with engine routes generated by weights other than `current`."""
        if not (self.config.return_routed_experts and sample.response_ids and current):
            return False
        return any(v and v != current for v in sample.weight_versions)

    @staticmethod
    def _reset(sample: Sample) -> None:
        sample.response_ids, sample.logprobs, sample.loss_mask, sample.weight_versions = [], [], [], []
        sample.num_segments, sample.status, sample.finish_reason = 0, PENDING, None
        sample.reward, sample.routed_experts, sample.teacher_logprobs = None, None, None

    def _metrics(self, kept: list[list[Sample]], m: collections.Counter, seconds: float) -> dict[str, float]:
        return step_metrics(kept, m, seconds, buffer_groups=len(self.buffer), budget=self.reward_budget,
                            episodes=self.env_factory is not None)

    # --- checkpointing -----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The buffer and counters as plain data (JSON-serialisable when prompt records are)."""
        return {"next_group_id": self.next_group_id,
                "buffer": [[s.to_dict() for s in g] for g in self.buffer],
                "ready": [[s.to_dict() for s in g] for g in self.ready],
                "reward_budget": self.reward_budget.to_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.next_group_id = int(state["next_group_id"])
        self.buffer = collections.deque([Sample.from_dict(d) for d in g] for g in state["buffer"])
        self.ready = collections.deque([Sample.from_dict(d) for d in g] for g in state.get("ready", []))
        self.reward_budget.load_state(state["reward_budget"])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._own_scorer is not None:
            self._own_scorer.close()
