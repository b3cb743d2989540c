"""Rollouts that overlap training: a background thread keeps the SGLang servers generating into a
bounded queue of finished groups, and stops only at weight syncs and checkpoints.

    producer = AsyncRollouts(manager, stream, batch_groups=16, max_groups=48, max_tokens=None,
                             version=lambda: "7")
    groups = producer.take(16, should_stop=...)       # the trainer, at each step
    with producer.paused():                            # a weight sync or a checkpoint
        ...                                            # nothing generates; state is consistent
    producer.close()

The thread runs RolloutManager.generate_step batch after batch, so dynamic sampling,
over-sampling, partial rollouts and multi-turn episodes behave as in the synchronous loop; each
finished group goes to the queue in batch order (group ids ascending within a batch). `paused()`
makes the running step stop: its in-flight requests are aborted, their partial responses (with the
weight version of every token so far) go back to the manager's buffer and resume after the pause,
under the new weights; its complete groups wait in the manager's `ready` list. So a response cut
by a weight sync carries two versions, never an unrecorded mix (SGLang labels a whole response with
one version). A multi-turn episode cut at a turn restarts from its prompt; a response with engine
routes resumes like the others, each token keeping the routes of the pass that sampled it
(routing replay, docs/async.md "R3").

Back-pressure: no new batch starts while the queue holds `max_groups - batch_groups` groups or
`max_tokens` tokens; the thread waits instead of growing the queue.

Busy time: the thread records when it is inside a generate call (waiting at the back-pressure
gate or at a pause is idle), for the busy-fraction and overlap metrics.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from rollout.generation.manager import RolloutInterrupted, RolloutManager
from rollout.generation.sample import Sample


def group_tokens(group: list[Sample]) -> int:
    return sum(len(s.tokens) for s in group)


class AsyncRollouts:
    """The background rollout thread of an asynchronous run (rank 0 of the trainer)."""

    def __init__(self, manager: RolloutManager, prompts: Iterator[dict], *, batch_groups: int,
                 max_groups: int, max_tokens: int | None, version: Callable[[], str]) -> None:
        if max_groups < batch_groups:
            raise ValueError(f"max_groups={max_groups} must hold at least one batch ({batch_groups})")
        self.manager, self.prompts = manager, prompts
        self.batch_groups, self.max_groups, self.max_tokens = batch_groups, max_groups, max_tokens
        self.version = version
        self.queue: collections.deque[list[Sample]] = collections.deque()
        self.retry: collections.deque[list[Sample]] = collections.deque()  # groups to generate again
        self.metrics: collections.Counter = collections.Counter()  # the manager's, summed since taken
        self.busy: list[tuple[float, float]] = []  # generate intervals (monotonic)
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._pauses = 0          # paused() callers waiting or inside
        self._generating = False  # the thread is inside generate_step
        self._closed = False
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="async-rollouts", daemon=True)

    def start(self) -> None:
        """Start generating (after load_state on a resume)."""
        self._thread.start()

    # --- the thread ------------------------------------------------------------------------------
    def _room(self) -> bool:
        groups = len(self.queue) + self.batch_groups <= self.max_groups
        tokens = self.max_tokens is None or sum(group_tokens(g) for g in self.queue) < self.max_tokens
        return groups and tokens

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (not self._pauses and self._room()))
                if self._closed:
                    return
                while self.retry:  # stale groups sent back: generated again, first
                    self.manager.groups.buffer.appendleft(self.retry.pop())
                self._generating = True
                self._busy_since = t0 = time.monotonic()
            result = None
            try:
                result = self.manager.generate_step(
                    self.prompts, self.batch_groups, current_weight_version=self.version(),
                    should_stop=lambda: self._pauses > 0 or self._closed, keep_on_stop=True)
            except RolloutInterrupted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the trainer by take()
                with self._cond:
                    self.busy.append((t0, time.monotonic()))
                    self.error, self._generating, self._busy_since = e, False, None
                    self._cond.notify_all()
                return
            with self._cond:
                self.busy.append((t0, time.monotonic()))
                self._generating, self._busy_since = False, None
                if result is not None:
                    self.queue.extend(result.groups)
                    self.metrics.update({k: v for k, v in result.metrics.items()
                                         if isinstance(v, (int, float))})
                    self.metrics["batches"] += 1
                self._cond.notify_all()

    # --- the trainer's side ------------------------------------------------------------------------
    def take(self, n: int, should_stop: Callable[[], bool] | None = None) -> list[list[Sample]] | None:
        """The next `n` queued groups, waiting for them; None when `should_stop` says so while
        waiting (nothing is taken then). Raises the thread's error, if it failed."""
        with self._cond:
            while len(self.queue) < n:
                if self.error is not None:
                    raise self.error
                if should_stop is not None and should_stop():
                    return None
                self._cond.wait(timeout=0.2)
            out = [self.queue.popleft() for _ in range(n)]
            self._cond.notify_all()
            return out

    def put_back(self, groups: list[list[Sample]]) -> None:
        """Groups taken but not trained: back to the front of the queue, in order."""
        with self._cond:
            self.queue.extendleft(reversed(groups))
            self._cond.notify_all()

    def regenerate(self, groups: list[list[Sample]]) -> None:
        """Groups to generate again from their prompts (too stale to train)."""
        for group in groups:
            for s in group:
                s.restart()
        with self._cond:
            self.retry.extend(groups)
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing generates inside: the running step is stopped (in-flight requests aborted,
        their partial responses kept) and no new one starts until the block ends."""
        with self._cond:
            self._pauses += 1
            self._cond.wait_for(lambda: not self._generating)
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    def pop_metrics(self) -> dict[str, float]:
        with self._cond:
            out, self.metrics = dict(self.metrics), collections.Counter()
            return out

    def busy_spans(self, start: float, end: float) -> list[tuple[float, float]]:
        """The thread's generate intervals clipped to [start, end] (one still running counts up to
        `end`); older ones are forgotten."""
        with self._cond:
            self.busy = [(a, b) for a, b in self.busy if b > start]
            spans, since = list(self.busy), self._busy_since
        if since is not None:
            spans.append((since, end))
        out = []
        for a, b in spans:
            a, b = max(a, start), min(b, end)
            if b > a:
                out.append((a, b))
        return out

    # --- state --------------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """Call inside paused(): the queue and the groups to generate again, as plain data."""
        return {"queue": [[s.to_dict() for s in g] for g in self.queue],
                "retry": [[s.to_dict() for s in g] for g in self.retry]}

    def load_state(self, state: dict[str, Any]) -> None:
        with self._cond:
            self.queue = collections.deque([Sample.from_dict(d) for d in g] for g in state.get("queue", []))
            self.retry = collections.deque([Sample.from_dict(d) for d in g] for g in state.get("retry", []))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
