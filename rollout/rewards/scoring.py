"""What a scored response is, and the error accounting around rewards.

    future = scorer.submit(records, texts)     # a group: RewardWorkerPool (workers.py) or ThreadScorer
    scores = future.result()                   # one Score per response, never an exception
    budget.record(score.ok, score.error)       # RewardErrorBudget: the run fails past its fraction

Every way a reward call can fail ends in a Score with reward 0.0 and an `error` naming it: the
function raised, returned something that is not a finite number, ran past rollout.reward_timeout_s
(its worker killed), or its worker died (os._exit, a segfault, the OOM killer). One failure is not
the response's: the code sandbox failing to start a run (status "sandbox", from an exception
whose class carries `score_status`): the response was never judged, so it is no reward error; it
is counted and said on its own, its group is left out of the step, and the run stops only when
the sandbox fails SANDBOX_FAILURES_IN_A_ROW times in a row (the machine, not a response).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

from gspo_errors import GspoError

# Score.status values
OK, ERROR, TIMEOUT, DIED, SANDBOX = "ok", "error", "timeout", "died", "sandbox"
SANDBOX_FAILURES_IN_A_ROW = 32
"""Sandbox failures in a row, with no call judged between them, that stop the run: the sandbox no
longer starts on this machine. A response's run cannot cause them (docs/rewards.md), and one
failing now and then (a host budget spent by someone else for a moment) is retried and counted."""


@dataclasses.dataclass
class Score:
    reward: float
    error: str | None = None
    """Why the reward is 0.0 instead of the function's value (None when it is the value)."""
    status: str = OK
    """ok, error (raised or returned a non-number), timeout, died, sandbox (the code sandbox failed
    to start a run: not the response's doing, never a reward error)."""
    seconds: float = 0.0
    """Scoring time of this response (a batched call's time split evenly over its responses)."""

    @property
    def ok(self) -> bool:
        return self.status == OK


def as_reward(value: Any) -> float:
    """The float a reward function returned, or ValueError saying what it returned instead."""
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        f = float(value)
        if math.isfinite(f):
            return f
        raise ValueError(f"returned {f} (expected a finite number)")
    raise ValueError(f"returned {value!r:.60} of type {type(value).__name__} (expected a number)")


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def status_of(e: BaseException) -> str:
    """The Score status of a reward call that raised `e`: ERROR, unless its class says otherwise
    (the code sandbox's SandboxFailure: SANDBOX)."""
    return getattr(e, "score_status", ERROR)


class Scorer(Protocol):
    def submit(self, records: list[dict], texts: list[str]) -> "Future[list[Score]]": ...
    def close(self) -> None: ...


class ThreadScorer:
    """Scores an in-process callable on a thread of its own (the thread that feeds the servers never
    scores). For the Python API, where the reward is a lambda or a closure that cannot be imported
    by a worker process; it has no hard time bound: a hung call hangs its thread. The trainer always
    uses RewardWorkerPool."""

    def __init__(self, fn: Callable[[dict, str], float]) -> None:
        self.fn = fn
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def _score_all(self, records: list[dict], texts: list[str]) -> list[Score]:
        out = []
        for record, text in zip(records, texts):
            t0 = time.perf_counter()
            try:
                out.append(Score(as_reward(self.fn(record, text)), seconds=time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - a buggy reward must not kill a long run; it is counted
                out.append(Score(0.0, error_text(e), status_of(e), time.perf_counter() - t0))
        return out

    def submit(self, records: list[dict], texts: list[str]) -> "Future[list[Score]]":
        return self._executor.submit(self._score_all, records, texts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RewardErrorBudgetExceeded(GspoError, RuntimeError):
    pass


class RewardErrorBudget:
    """Counts reward calls and failures over the run; raises past `max_error_fraction`
    (checked once at least `min_calls` calls were made, so one early failure does not end a run).
    The first failure this process sees is said in one line on `log` (what failed: the function's
    error, the HTTP judge's URL and answer); the per-step counts go to rollout/reward_errors and
    the progress line, so a judge that is down is never a silent row of 0.0 rewards."""

    def __init__(self, max_error_fraction: float = 0.0, min_calls: int = 1,
                 log: Callable[[str], None] = lambda line: print(f"[gspo] {line}", flush=True),
                 what: str = "this run"):
        """what: whose calls these are, for the first error's line ("the held-out eval")."""
        self.max_error_fraction, self.min_calls, self.log, self.what = max_error_fraction, min_calls, log, what
        self.calls = 0
        self.errors = 0
        self.last_error: str | None = None
        self.sandbox_failures = 0
        """Calls the code sandbox failed to start (module docstring): counted here, not in errors."""
        self.sandbox_in_a_row = 0
        self._said = False  # the first error of this process was said (a resume says its own)
        self._lock = threading.Lock()  # the train and the eval managers may share one budget

    def record(self, ok: bool, error: str | None = None, status: str | None = None) -> None:
        if status == SANDBOX:
            self._sandbox_failed(error)
            return
        with self._lock:
            self.sandbox_in_a_row = 0
            self.calls += 1
            if not ok:
                self.errors += 1
                self.last_error = error
                if not self._said:
                    self._said = True
                    bound = (f"; past rollout.max_reward_error_fraction={self.max_error_fraction:g} "
                             "of the calls the run stops" if self.max_error_fraction < 1 else "")
                    self.log(f"reward error, the first of {self.what} (scored 0 and counted{bound}): {error}")
            if (self.calls >= self.min_calls
                    and self.errors > self.max_error_fraction * self.calls):
                raise RewardErrorBudgetExceeded(
                    f"the reward (or environment) failed {self.errors} of {self.calls} times "
                    f"(> rollout.max_reward_error_fraction {self.max_error_fraction}); last error: "
                    f"{self.last_error}")

    def _sandbox_failed(self, error: str | None) -> None:
        with self._lock:
            self.sandbox_failures += 1
            self.sandbox_in_a_row += 1
            if self.sandbox_failures == 1:
                self.log(f"code sandbox failure, the first of {self.what} (not the response's: no reward error; "
                         f"its group is left out, counted as reward/sandbox_failures): {error}")
            if self.sandbox_in_a_row >= SANDBOX_FAILURES_IN_A_ROW:
                raise RewardErrorBudgetExceeded(
                    f"the code sandbox failed to start {self.sandbox_in_a_row} runs in a row, with no response "
                    f"judged between them: it no longer starts on this machine; last: {error}")

    def to_state(self) -> dict[str, Any]:
        return {"calls": self.calls, "errors": self.errors, "last_error": self.last_error}

    def load_state(self, state: dict[str, Any]) -> None:
        self.calls, self.errors, self.last_error = state["calls"], state["errors"], state["last_error"]
