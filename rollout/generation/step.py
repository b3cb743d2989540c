"""One rollout step's generation: the groups being filled, the requests in flight, their scoring.

    step = StepGeneration(manager, prompts, num_groups, current_weight_version, should_stop,
                          keep_on_stop)
    result = step.run()     # StepResult; what RolloutManager.generate_step returns

A step takes the manager's ready groups, then its buffered groups, then new prompts, and keeps
`num_groups` + `oversample_groups` groups open. Every sample of an open group goes to the manager's
executor (one request per sample); a group whose responses are all done goes to the scorer (and
the teacher), and is kept when their answers are back. This thread only hands work over and waits
on generation, scoring and the teacher together. When the step is full, stopped (`should_stop`) or
out of servers, what is in flight is aborted and drained, and the open groups go back to the
manager's buffer (or are discarded: rollout/generation/manager.py's docstring says which).

The state is the fields below, alive for one step. At the paper's batch (8,192 responses a step)
`kept` and `open_groups` hold references to about that many Samples (their tokens are not copied);
`in_flight` holds at most `max_in_flight_requests` requests.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Callable, Iterator

from rollout.generation.drain import drain
from rollout.generation.sample import ABORTED, DONE, Sample
from rollout.generation.step_metrics import step_metrics
from rollout.rewards.scoring import DIED, TIMEOUT, Score
from rollout.servers.errors import NoServerLeft

if TYPE_CHECKING:  # manager.py builds a step for each generate_step
    from rollout.generation.manager import RolloutManager


class RolloutInterrupted(Exception):
    """generate_step stopped because `should_stop` said so (a graceful stop of the run)."""


@dataclasses.dataclass
class StepResult:
    groups: list[list[Sample]]
    """num_groups complete groups of group_size samples each, rewards set."""
    metrics: dict[str, float]


class StepGeneration:
    """One call of RolloutManager.generate_step (its docstring gives the arguments' meaning).
    `manager` is the RolloutManager whose step this is: the step submits through its request
    threads (manager.requests), scores with its scorer, teacher and reward budget, draws new
    groups from it (new_group) and hands groups to and from its buffer and ready groups."""

    def __init__(self, manager: RolloutManager, prompts: Iterator[dict], num_groups: int,
                 current_weight_version: str | None = None,
                 should_stop: Callable[[], bool] | None = None, keep_on_stop: bool = False):
        cfg = manager.config
        self.manager, self.config = manager, cfg
        self.prompts, self.num_groups = prompts, num_groups
        self.current_weight_version = current_weight_version
        self.should_stop, self.keep_on_stop = should_stop, keep_on_stop
        self.t0 = self.last_done = time.monotonic()
        self.poll = cfg.request_timeout_s if should_stop is None else min(0.2, cfg.request_timeout_s)
        self.kept: list[list[Sample]] = []
        """Complete, scored groups of this step, in the order they closed."""
        self.open_groups: dict[int, list[Sample]] = {}
        """Group id -> a group started and not yet closed (generating, or waiting on its answers)."""
        self.in_flight: dict[Future, Sample] = {}
        """A generation request (manager.requests.submit) -> its sample."""
        self.scoring: dict[Future, tuple[list[Sample], list[Sample]]] = {}
        """A scorer call -> (its group, the group's samples it scores)."""
        self.teaching: dict[Future, list[Sample]] = {}
        """A teacher call (distillation log-probs) -> its group."""
        self.waits: dict[int, int] = {}
        """Group id -> answers (scores, teacher log-probs) still to come."""
        self.counts: collections.Counter = collections.Counter()
        """The step's counters, reported as its metrics (step_metrics.py)."""
        self.max_draws = math.ceil(num_groups * cfg.max_draw_factor)
        self.interrupted = False
        """should_stop said so: the step ends with RolloutInterrupted."""
        self.lost: NoServerLeft | None = None
        """No server left in service (the policy's, or the teacher's: NoTeacherLeft): the step
        ends as at should_stop, then raises this."""

    # --- the step ----------------------------------------------------------------------------
    def run(self) -> StepResult:
        """Fill the step; RolloutInterrupted or NoServerLeft when it stopped (manager docstring)."""
        manager, cfg, m = self.manager, self.config, self.counts
        while manager.ready and len(self.kept) < self.num_groups:
            self.kept.append(manager.ready.popleft())
        try:
            while len(self.kept) < self.num_groups and self.lost is None:
                self.open_more()
                if len(self.kept) >= self.num_groups:
                    break
                if not self.in_flight and not self.scoring and not self.teaching:
                    raise RuntimeError(
                        f"rollout step cannot fill {self.num_groups} groups: {len(self.kept)} kept, "
                        f"{m['groups_dropped_equal_reward']} dropped (all rewards equal), "
                        f"{m['prompts_drawn']} prompts drawn (limit {self.max_draws} = max_draw_factor "
                        f"{cfg.max_draw_factor} x {self.num_groups}), or the prompt iterator ran out")
                if self.should_stop is not None and self.should_stop():
                    self.interrupted = True
                    break
                done = self.wait_for_answers()
                if done:
                    self.collect(done)
        finally:
            drain(manager.pool, self.in_flight, min(cfg.abort_timeout_s, cfg.request_timeout_s),
                  manager.requests.abandon)
        if self.interrupted or self.lost is not None:
            raise self.stopped_early()
        self.buffer_open_groups()
        return StepResult(self.kept, step_metrics(self.kept, m, time.monotonic() - self.t0,
                                                  buffer_groups=len(manager.buffer),
                                                  budget=manager.reward_budget, episodes=manager.episodes))

    def open_more(self) -> None:
        """Start groups, buffered ones first, until num_groups + oversample_groups are kept or open."""
        manager, m = self.manager, self.counts
        while len(self.kept) + len(self.open_groups) < self.num_groups + self.config.oversample_groups:
            if manager.buffer:
                self.start_group(manager.buffer.popleft())
                m["groups_from_buffer"] += 1
                continue
            record = next(self.prompts, None) if m["prompts_drawn"] < self.max_draws else None
            if record is None:
                break
            m["prompts_drawn"] += 1
            self.start_group(manager.new_group(record))

    def wait_for_answers(self) -> set[Future]:
        """Wait up to one poll for a request, a score or a teacher answer; TimeoutError when no
        request has finished within request_timeout_s."""
        cfg, m = self.config, self.counts
        only_scoring, waited = not self.in_flight, time.monotonic()
        done, _ = wait([*self.in_flight, *self.scoring, *self.teaching], timeout=self.poll,
                       return_when=FIRST_COMPLETED)
        if only_scoring:  # what scoring costs this thread: waiting with nothing generating
            m["reward_wait_seconds"] += time.monotonic() - waited
        if not done:
            # scoring is bounded by the scorer (reward_timeout_s per call); this bounds generation
            if time.monotonic() - self.last_done < cfg.request_timeout_s or not self.in_flight:
                return done
            raise TimeoutError(f"no rollout request finished within {cfg.request_timeout_s} s "
                               f"({len(self.in_flight)} in flight)")
        self.last_done = time.monotonic()
        return done

    def collect(self, done: set[Future]) -> None:
        """Apply what came back; a request that lost the last server sets `lost` and ends this."""
        for f in done:
            if f in self.scoring:
                group, unscored = self.scoring.pop(f)
                self.apply_scores(group, unscored, f.result())  # RewardWorkerError propagates
                continue
            if f in self.teaching:
                group = self.teaching.pop(f)
                try:
                    results = f.result()
                except NoServerLeft as e:  # no teacher server left (NoTeacherLeft): as below; the
                    self.lost = e          # group stays open and asks the teacher again next time
                    return
                self.apply_teacher(group, results)
                continue
            sample = self.in_flight.pop(f)
            try:
                f.result()  # a server failure propagates here
            except NoServerLeft as e:  # the step stops as at a signal (keep_on_stop: nothing lost)
                self.lost = e
                if self.manager.episodes:
                    sample.status = ABORTED  # an episode restarts from its prompt
                return
            if sample.status != DONE:  # aborted by someone else before we were full: resume
                if sample.status == ABORTED:
                    sample.restart()
                self.submit(sample)
                continue
            # several samples of a group can finish together: the first one closes it
            group = self.open_groups.get(sample.group_id)
            if group is not None and all(s.status == DONE for s in group):
                self.finish_group(group)

    def stopped_early(self) -> Exception:
        """The step stopped before it was full: keep_on_stop hands its groups back to the manager
        (complete ones to `ready`, open ones to the front of the buffer, in group order). Returns
        what run() raises: the lost servers' NoServerLeft, else RolloutInterrupted."""
        manager = self.manager
        message = f"rollout interrupted with {len(self.kept)} of {self.num_groups} groups complete"
        if self.keep_on_stop:
            manager.ready.extendleft(reversed(self.kept))
            manager.buffer.extendleft(sorted(self.open_groups.values(), key=lambda g: -g[0].group_id))
        if self.lost is not None:
            return self.lost
        return RolloutInterrupted(message)

    def buffer_open_groups(self) -> None:
        """The step is full: its groups still open go to the manager's buffer or are discarded."""
        manager, m = self.manager, self.counts
        for group in sorted(self.open_groups.values(), key=lambda g: g[0].group_id):
            if all(s.status == DONE for s in group):
                manager.buffer.append(group)
                m["groups_completed_buffered"] += 1
            elif self.config.partial_rollouts and not manager.episodes:
                manager.buffer.append(group)
                m["groups_partial_buffered"] += 1
            else:
                m["groups_discarded"] += 1

    # --- a group's life: start, generate, score, close ---------------------------------------
    def submit(self, sample: Sample) -> None:
        self.in_flight[self.manager.requests.submit(sample)] = sample

    def start_group(self, group: list[Sample]) -> None:
        m = self.counts
        self.open_groups[group[0].group_id] = group
        for s in group:
            if s.status == ABORTED:  # an episode cut by a stop: it restarts
                s.restart()
            if s.status != DONE:
                m["samples_resumed"] += bool(s.response_ids)
                self.submit(s)
        if all(s.status == DONE for s in group):
            self.finish_group(group)

    def finish_group(self, group: list[Sample]) -> None:
        """Every response of the group is done: score it (and ask the teacher), or close it."""
        manager, waits = self.manager, self.waits
        gid = group[0].group_id
        if gid in waits:  # its samples finished together: asked already
            return
        for s in group:
            s.check_aligned()
        waits[gid] = 0
        unscored = [s for s in group if s.reward is None]
        if unscored and not manager.episodes:
            future = manager.scorer.submit([s.prompt for s in unscored],
                                           [manager.decode(s.response_ids) for s in unscored])
            self.scoring[future] = (group, unscored)
            waits[gid] += 1
        if manager.teacher is not None and any(s.teacher_logprobs is None for s in group):
            self.teaching[manager.teacher.submit(group)] = group
            waits[gid] += 1
        if not waits[gid]:
            self.close_group(group)

    def answered(self, group: list[Sample]) -> None:
        self.waits[group[0].group_id] -= 1
        if not self.waits[group[0].group_id]:
            self.close_group(group)

    def apply_teacher(self, group: list[Sample], results: list[tuple[list[float], float]]) -> None:
        m = self.counts
        for s, (lps, seconds) in zip(group, results):
            s.teacher_logprobs = lps
            m["teacher_seconds"] += seconds
            m["teacher_tokens"] += len(lps)
        self.answered(group)

    def apply_scores(self, group: list[Sample], unscored: list[Sample], scores: list[Score]) -> None:
        m = self.counts
        for s, score in zip(unscored, scores):
            s.reward, s.reward_error = score.reward, score.error
            s.metadata["reward_seconds"] = score.seconds
            m["reward_errors"] += not score.ok
            m["reward_timeouts"] += score.status == TIMEOUT
            m["reward_worker_restarts"] += score.status in (TIMEOUT, DIED)
            m["reward_seconds"] += score.seconds
            self.manager.reward_budget.record(score.ok, score.error)
        self.answered(group)

    def close_group(self, group: list[Sample]) -> None:
        manager, cfg, m = self.manager, self.config, self.counts
        del self.open_groups[group[0].group_id]
        self.waits.pop(group[0].group_id, None)
        for s in group:
            if manager.episodes:  # an episode's reward came from its environment
                error = s.metadata.get("env_error")
                m["env_errors"] += error is not None
                manager.reward_budget.record(error is None, error)
            if cfg.mask_stale_tokens:
                versions = [v for v in s.weight_versions if v]
                newest = self.current_weight_version or (versions[-1] if versions else "")
                m["stale_tokens_masked"] += s.mask_stale_tokens(newest)
        if cfg.dynamic_sampling and len({s.reward for s in group}) == 1:
            m["groups_dropped_equal_reward"] += 1
        elif len(self.kept) < self.num_groups:
            self.kept.append(group)
        else:  # finished in the same instant as the last needed group: keep for next step
            manager.buffer.appendleft(group)
            m["groups_completed_buffered"] += 1
