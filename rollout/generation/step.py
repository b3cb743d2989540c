"""One rollout step's generation: the groups being filled, the requests in flight, their scoring.

    step = StepGeneration(parts, prompts, num_groups, current_weight_version, should_stop,
                          keep_on_stop)
    result = step.run()     # StepResult; what RolloutManager.generate_step returns

`parts` (StepParts) are the step's collaborators, all owned by the RolloutManager: the group
buffer (groups.py), the request threads, the scorer, the teacher, the server pool. A step takes
the ready groups, then the buffered groups, then new prompts, and keeps `num_groups` +
`oversample_groups` groups open. Every sample of an open group goes to the request threads (one
request per sample); a group whose responses are all done goes to the scorer (and the teacher),
and is kept when their answers are back. This thread only hands work over and waits on
generation, scoring and the teacher together. When the step is full, stopped (`should_stop`) or
out of servers, what is in flight is aborted and drained, and the open groups go back to the
group buffer (or are discarded: rollout/generation/manager.py's docstring says which).

The state is the fields below, alive for one step. At the paper's batch (8,192 responses a step)
`kept` and `open_groups` hold references to about that many Samples (their tokens are not copied);
`in_flight` holds at most `max_in_flight_requests` requests.
"""
from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Callable, Iterator

from rollout.generation.drain import drain
from rollout.generation.groups import GroupBuffer
from rollout.generation.manager_config import ManagerConfig
from rollout.generation.sample import ABORTED, DONE, Sample
from rollout.generation.step_metrics import StepCounts, step_metrics
from rollout.rewards.scoring import DIED, SANDBOX, TIMEOUT, RewardErrorBudget, Score, Scorer
from rollout.servers.errors import NoServerLeft

if TYPE_CHECKING:  # types only: importing them would load the request threads' and the teacher's modules
    from rollout.generation.requests import SampleRequests
    from rollout.generation.teacher import TeacherScorer
    from rollout.servers.pool import ServerPool


class RolloutInterrupted(Exception):
    """generate_step stopped because `should_stop` said so (a graceful stop of the run)."""


@dataclasses.dataclass
class StepResult:
    groups: list[list[Sample]]
    """num_groups complete groups of group_size samples each, rewards set."""
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step works with, all owned by the RolloutManager (RolloutManager.parts)."""

    config: ManagerConfig
    groups: GroupBuffer
    """Groups to and from other steps: the step takes ready and buffered ones, and gives back
    what it leaves unfinished (or keeps, when stopped)."""
    requests: SampleRequests
    """The request threads: one request (or episode) per sample."""
    pool: ServerPool
    """The servers the requests go to, aborted when the step ends (drain.py)."""
    new_group: Callable[[dict], list[Sample]]
    """A prompt record -> a fresh group of group_size samples, with the next group id."""
    episodes: bool
    """Multi-turn episodes: the environment scores them, the scorer is not asked."""
    scorer: Scorer | None
    """Scores single-turn groups (None only for episodes)."""
    decode: Callable[[list[int]], str]
    """Token ids -> the text the scorer reads."""
    teacher: TeacherScorer | None
    """On-policy distillation: a group also waits for its teacher log-probs."""
    reward_budget: RewardErrorBudget
    """The run's reward error accounting: every score (or episode) is recorded."""


class StepGeneration:
    """One call of RolloutManager.generate_step (its docstring gives the arguments' meaning),
    with the manager's parts (StepParts)."""

    def __init__(self, parts: StepParts, prompts: Iterator[dict], num_groups: int,
                 current_weight_version: str | None = None,
                 should_stop: Callable[[], bool] | None = None, keep_on_stop: bool = False):
        cfg = parts.config
        self.parts, self.groups, self.config = parts, parts.groups, cfg
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
        """A generation request (parts.requests.submit) -> its sample."""
        self.scoring: dict[Future, tuple[list[Sample], list[Sample]]] = {}
        """A scorer call -> (its group, the group's samples it scores)."""
        self.teaching: dict[Future, list[Sample]] = {}
        """A teacher call (distillation log-probs) -> its group."""
        self.waits: dict[int, int] = {}
        """Group id -> answers (scores, teacher log-probs) still to come."""
        self.counts = StepCounts()
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
        parts, groups, cfg, m = self.parts, self.groups, self.config, self.counts
        while groups.ready and len(self.kept) < self.num_groups:
            self.kept.append(groups.ready.popleft())
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
            drain(parts.pool, self.in_flight, min(cfg.abort_timeout_s, cfg.request_timeout_s),
                  parts.requests.abandon)
        if self.interrupted or self.lost is not None:
            raise self.stopped_early()
        self.buffer_open_groups()
        return StepResult(self.kept, step_metrics(self.kept, m, time.monotonic() - self.t0,
                                                  buffer_groups=len(groups.buffer),
                                                  budget=parts.reward_budget, episodes=parts.episodes))

    def open_more(self) -> None:
        """Start groups, buffered ones first, until num_groups + oversample_groups are kept or open."""
        groups, m = self.groups, self.counts
        while len(self.kept) + len(self.open_groups) < self.num_groups + self.config.oversample_groups:
            if groups.buffer:
                self.start_group(groups.buffer.popleft())
                m["groups_from_buffer"] += 1
                continue
            record = next(self.prompts, None) if m["prompts_drawn"] < self.max_draws else None
            if record is None:
                break
            m["prompts_drawn"] += 1
            self.start_group(self.parts.new_group(record))

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
                if self.parts.episodes:
                    sample.status = ABORTED  # an episode restarts from its prompt
                return
            if sample.status != DONE:  # aborted by someone else before we were full: resume
                if sample.status == ABORTED:
                    sample.restart()
                self.submit(sample)
                continue
            # several samples of a group can finish together: the first one closes it
            open_group = self.open_groups.get(sample.group_id)
            if open_group is not None and all(s.status == DONE for s in open_group):
                self.finish_group(open_group)

    def stopped_early(self) -> Exception:
        """The step stopped before it was full: keep_on_stop hands its groups back to the group
        buffer (complete ones to `ready`, open ones to the front of the buffer, in group order). Returns
        what run() raises: the lost servers' NoServerLeft, else RolloutInterrupted."""
        groups = self.groups
        message = f"rollout interrupted with {len(self.kept)} of {self.num_groups} groups complete"
        if self.keep_on_stop:
            groups.ready.extendleft(reversed(self.kept))
            groups.buffer.extendleft(sorted(self.open_groups.values(), key=lambda g: -g[0].group_id))
        if self.lost is not None:
            return self.lost
        return RolloutInterrupted(message)

    def buffer_open_groups(self) -> None:
        """The step is full: its groups still open go to the group buffer or are discarded."""
        groups, m = self.groups, self.counts
        for group in sorted(self.open_groups.values(), key=lambda g: g[0].group_id):
            if all(s.status == DONE for s in group):
                groups.buffer.append(group)
                m["groups_completed_buffered"] += 1
            elif self.config.partial_rollouts and not self.parts.episodes:
                groups.buffer.append(group)
                m["groups_partial_buffered"] += 1
            else:
                m["groups_discarded"] += 1

    # --- a group's life: start, generate, score, close ---------------------------------------
    def submit(self, sample: Sample) -> None:
        self.in_flight[self.parts.requests.submit(sample)] = sample

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
        parts, waits = self.parts, self.waits
        gid = group[0].group_id
        if gid in waits:  # its samples finished together: asked already
            return
        for s in group:
            s.check_aligned()
        waits[gid] = 0
        unscored = [s for s in group if s.reward is None]
        if unscored and not parts.episodes:
            if parts.scorer is None:
                raise RuntimeError("a single-turn group to score, and no scorer")
            future = parts.scorer.submit([s.prompt for s in unscored],
                                         [parts.decode(s.response_ids) for s in unscored])
            self.scoring[future] = (group, unscored)
            waits[gid] += 1
        if parts.teacher is not None and any(s.teacher_logprobs is None for s in group):
            self.teaching[parts.teacher.submit(group)] = group
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
            if score.status == SANDBOX:  # not judged, and not the response's doing: its group is left out
                s.metadata["sandbox_failure"] = score.error
                m["reward_sandbox_failures"] += 1
            else:
                m["reward_errors"] += not score.ok
            m["reward_timeouts"] += score.status == TIMEOUT
            m["reward_worker_restarts"] += score.status in (TIMEOUT, DIED)
            m["reward_seconds"] += score.seconds
            self.parts.reward_budget.record(score.ok, score.error, score.status)
        self.answered(group)

    def close_group(self, group: list[Sample]) -> None:
        parts, cfg, m = self.parts, self.config, self.counts
        del self.open_groups[group[0].group_id]
        self.waits.pop(group[0].group_id, None)
        for s in group:
            if parts.episodes:  # an episode's reward came from its environment
                error = s.metadata.get("env_error")
                m["env_errors"] += error is not None
                parts.reward_budget.record(error is None, error)
            if cfg.mask_stale_tokens:
                versions = [v for v in s.weight_versions if v]
                newest = self.current_weight_version or (versions[-1] if versions else "")
                m["stale_tokens_masked"] += s.mask_stale_tokens(newest)
        if any("sandbox_failure" in s.metadata for s in group):
            m["groups_dropped_sandbox"] += 1
        elif cfg.dynamic_sampling and len({s.reward for s in group}) == 1:
            m["groups_dropped_equal_reward"] += 1
        elif len(self.kept) < self.num_groups:
            self.kept.append(group)
        else:  # finished in the same instant as the last needed group: keep for next step
            self.groups.buffer.appendleft(group)
            m["groups_completed_buffered"] += 1
