"""Reward workers: processes that score concurrently with generation, each call bounded in time.

    pool = RewardWorkerPool("math", workers=8, timeout_s=60)
    future = pool.submit(records, texts)      # one group; returns at once
    scores = future.result()                  # a Score per response (scoring.py), never raises
    pool.close()

Why processes: a reward is user code, math-verify's sympy, a code sandbox or an HTTP judge. A call
can hang (sympy holds the GIL inside one C call for minutes), crash the interpreter (os._exit, a
segfault) or be OOM-killed. Only a process killed from outside bounds all of these. So:
- a call that runs past `timeout_s` has its worker killed (the whole process group) and replaced;
  the response scores 0.0 with status "timeout";
- a worker that dies mid-call is replaced; the response scores 0.0 with status "died";
- the rest of that group is sent to another worker, so one bad response costs one bound;
- but two timeouts in a row in one group fail the rest of it at once: the prompt (a gold that sends
  sympy computing 9^(9^(9^9)) on every comparison) costs two bounds, not G.
A reward's `prepare` (once per prompt: the parsed gold, the parsed tests) counts as a call of its
own; a timeout there fails the whole group at once.

One dispatcher thread owns the workers: it hands each idle worker the next group, reads results
as they come (select over the result pipes), and kills the ones past their deadline. The caller's
thread (the rollout manager's, which feeds the SGLang servers) only enqueues.

Scale: at the paper's 8,192 responses per step with 4k-token chains of thought (~16k characters),
a step's texts are ~130 MB through the pipes, and math-verify's ~26 ms per response is ~210 s of
CPU: 32 workers on the driver's node bring it to ~7 s, hidden behind generation
(benchmarks/rewards.py measures and projects it). Each worker is one Python process (~60-90 MB).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from gspo_errors import GspoError
from rollout.rewards.frames import FrameReader, send
from rollout.rewards.scoring import DIED, ERROR, OK, TIMEOUT, Score

SECRET = re.compile(r"_TOKEN$|_KEY$|SECRET|PASSWORD|PASSWD|CREDENTIAL|^AWS_|^HF_TOKEN$|^WANDB_API_KEY$", re.I)
"""Environment variables a reward worker of a shipped reward does not get: a worker runs the code
sandbox's programs, and what it holds is one bug away from them."""


def worker_environment(name: str) -> dict[str, str]:
    """The environment of a reward worker for reward `name`: this process's, less the secrets
    (SECRET) unless the reward is your own package.module:function, which may need its keys."""
    own = ":" in name and not name.startswith(("http://", "https://"))
    return {k: v for k, v in os.environ.items() if own or not SECRET.search(k)}


class RewardWorkerError(GspoError, RuntimeError):
    """The reward workers cannot run the reward at all (it fails to build in a fresh process, or
    workers die at start again and again); the message names the reward and the cause."""


@dataclasses.dataclass
class _Task:
    id: int
    records: list[dict]
    texts: list[str]
    future: Future
    scores: list[Score | None]
    next: int = 0  # first response not scored yet
    timeouts_in_a_row: int = 0


@dataclasses.dataclass
class _Worker:
    proc: subprocess.Popen
    task_fd: int
    result_fd: int
    reader: FrameReader = dataclasses.field(default_factory=FrameReader)
    ready: bool = False
    task: _Task | None = None
    offset: int = 0             # task.next when the task was sent
    preparing: bool = False     # inside prepare(): a timeout fails the rest of the group
    deadline: float = float("inf")
    call_start: float = 0.0
    started: float = 0.0


class RewardWorkerPool:
    """A fixed number of reward worker processes (module docstring)."""

    START_TIMEOUT_S = 120.0
    """A worker that has not built its reward by then is a start failure."""
    MAX_START_FAILURES = 3
    """Workers that die (or fail to build the reward) before their first result, in a row, before
    the pool gives up with RewardWorkerError."""

    def __init__(self, name: str, *, workers: int, timeout_s: float, args: Mapping[str, Any] | None = None,
                 plugins: Sequence[str] = ()) -> None:
        """name: the reward (registry.get_reward); args: its own settings as plain data
        (rollout.reward_args), built in each worker under the bound `timeout_s`; plugins: the
        modules each worker imports first (the run config's `plugins`: they register rows)."""
        if workers < 1:
            raise ValueError(f"reward workers={workers}: expected >= 1")
        self.name, self.workers, self.timeout_s = name, workers, timeout_s
        self.args, self.plugins = dict(args or {}), list(plugins)
        self.batched = False
        self._has_prepare = False
        self.restarts = 0
        self._lock = threading.Lock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._closed = False
        self._start_failures = 0
        self._pool: list[_Worker] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="reward-workers", daemon=True)
        self._thread.start()  # workers are started by this thread: their parent-death signal is its lifetime

    # --- the caller's side -------------------------------------------------------------------------
    def submit(self, records: list[dict], texts: list[str]) -> "Future[list[Score]]":
        """Score one group (any number of responses) in the workers."""
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("the reward worker pool is closed")
            self._queue.append(_Task(next(self._ids), list(records), list(texts), future, [None] * len(texts)))
        self._wake()
        return future

    def wait_ready(self, timeout_s: float | None = None, every: bool = False) -> None:
        """Block until a worker (`every`: each worker) has built the reward (RewardWorkerError if
        it cannot)."""
        deadline = time.monotonic() + (timeout_s or self.START_TIMEOUT_S)
        while time.monotonic() < deadline:
            with self._lock:
                if self._error is not None:
                    raise self._error
                ready = [w.ready for w in self._pool]
                if (all(ready) and len(ready) == self.workers) if every else any(ready):
                    return
            time.sleep(0.05)
        raise RewardWorkerError(f"reward {self.name!r}: no worker ready within {timeout_s or self.START_TIMEOUT_S} s")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout=30)
        for w in list(self._pool):
            self._kill(w)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "RewardWorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the dispatcher thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _spawn(self) -> None:
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        env = worker_environment(self.name)
        # the caller's import path, so a package.module:function importable here is importable there
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.rewards.worker_main", str(task_r), str(result_w), str(os.getpid())],
            pass_fds=(task_r, result_w), stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        os.close(task_r)
        os.close(result_w)
        os.set_blocking(result_r, False)
        now = time.monotonic()
        worker = _Worker(proc, task_w, result_r, started=now, deadline=now + self.START_TIMEOUT_S)
        self._pool.append(worker)
        send(task_w, ("init", self.name, self.args, self.timeout_s, self.plugins))

    def _kill(self, w: _Worker) -> None:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)  # the worker and anything it started (a sandbox)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            w.proc.kill()
        except ProcessLookupError:
            pass
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for fd in (w.task_fd, w.result_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if w in self._pool:
            self._pool.remove(w)

    def _fail(self, error: BaseException) -> None:
        """The pool cannot score: every waiting group's future gets the error."""
        with self._lock:
            self._error = error
            tasks = list(self._queue) + [w.task for w in self._pool if w.task is not None]
            self._queue.clear()
        for w in list(self._pool):
            self._kill(w)
        for t in tasks:
            if not t.future.done():
                t.future.set_exception(error)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or self._error is not None:
                        return
                while len(self._pool) < self.workers:
                    self._spawn()
                self._dispatch()
                now = time.monotonic()
                deadline = min((w.deadline for w in self._pool), default=float("inf"))
                fds = [self._wake_r] + [w.result_fd for w in self._pool]
                readable, _, _ = select.select(fds, [], [], max(0.0, min(deadline - now, 1.0)))
                if self._wake_r in readable:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                for w in list(self._pool):
                    if w.result_fd in readable:
                        self._read(w)
                now = time.monotonic()
                for w in list(self._pool):
                    if w in self._pool and now > w.deadline:
                        self._timed_out(w, now)
        except BaseException as e:  # noqa: BLE001 - never leave a caller waiting on a dead dispatcher
            self._fail(RewardWorkerError(f"reward worker pool failed: {type(e).__name__}: {e}"))

    def _dispatch(self) -> None:
        for w in self._pool:
            if not (w.ready and w.task is None):
                continue
            with self._lock:
                if not self._queue:
                    return
                task = self._queue.popleft()
            w.task, w.offset = task, task.next
            w.preparing = self._has_prepare
            w.call_start = time.monotonic()
            w.deadline = w.call_start + self.timeout_s
            try:
                send(w.task_fd, ("task", task.id, task.records[task.next:], task.texts[task.next:]))
            except OSError:  # it died while idle: the group goes to another; its end of file says how
                w.task, w.deadline = None, float("inf")
                with self._lock:
                    self._queue.appendleft(task)

    def _read(self, w: _Worker) -> None:
        try:
            data = os.read(w.result_fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
            data = b""
        if not data:
            self._died(w)
            return
        for message in w.reader.feed(data):
            self._on_message(w, message)

    def _on_message(self, w: _Worker, message: tuple) -> None:
        kind, now = message[0], time.monotonic()
        if kind == "ready":
            w.ready, self.batched, self._has_prepare = True, message[1], message[2]
            w.deadline = float("inf")
            self._start_failures = 0
            return
        if kind == "init_error":
            self._fail(RewardWorkerError(f"rollout.reward={self.name!r} fails in a reward worker: {message[1]}"))
            return
        task = w.task
        if task is None or message[1] != task.id:
            return
        if kind == "prepared":
            w.preparing, w.call_start, w.deadline = False, now, now + self.timeout_s
        elif kind == "score":
            _, _, i, reward, error, seconds, status = message
            task.scores[w.offset + i] = Score(reward, error, status, seconds)
            task.next = w.offset + i + 1
            task.timeouts_in_a_row = 0
            w.preparing = self._has_prepare and task.next < len(task.texts) and \
                task.records[task.next] is not task.records[task.next - 1]
            w.call_start, w.deadline = now, now + self.timeout_s
        elif kind == "batch":
            _, _, results, seconds = message
            share = seconds / max(1, len(results))
            for k, (reward, error) in enumerate(results):
                task.scores[w.offset + k] = Score(reward, error, OK if error is None else ERROR, share)
            task.next = len(task.texts)
        if task.next >= len(task.texts):
            w.task, w.deadline = None, float("inf")
            task.future.set_result(task.scores)

    def _start_failed(self, how: str) -> None:
        self._start_failures += 1
        if self._start_failures >= self.MAX_START_FAILURES:
            self._fail(RewardWorkerError(f"rollout.reward={self.name!r}: {self._start_failures} reward "
                                         f"workers in a row failed to start; the last {how}"))

    TIMEOUTS_IN_A_ROW = 2
    """Consecutive timeouts in one group that fail the rest of the group at once."""

    def _give_up_on_call(self, w: _Worker, status: str, why: str, seconds: float) -> None:
        """The call in flight on `w` ends as `status`; what is left of its group goes back to the queue."""
        task = w.task
        if task is None:
            return
        task.timeouts_in_a_row = task.timeouts_in_a_row + 1 if status == TIMEOUT else 0
        if self.batched or w.preparing:  # the call covered every response left of the group
            failed = range(task.next, len(task.texts))
            if w.preparing and not self.batched:
                why = f"{why} (while preparing the prompt's reference, e.g. parsing the gold answer)"
        elif task.timeouts_in_a_row >= self.TIMEOUTS_IN_A_ROW:
            failed = range(task.next, len(task.texts))
            why = (f"{why}; {self.TIMEOUTS_IN_A_ROW} calls in a row timed out on this prompt, so its "
                   f"{len(failed) - 1} other unscored responses were not scored (the prompt's reference "
                   f"is the likely cause)")
        else:
            failed = range(task.next, task.next + 1)
        share = seconds / max(1, len(failed))
        for i in failed:
            task.scores[i] = Score(0.0, why, status, share)
        task.next = failed.stop
        w.task = None
        if task.next >= len(task.texts):
            task.future.set_result(task.scores)
        else:
            with self._lock:
                self._queue.appendleft(task)

    def _timed_out(self, w: _Worker, now: float) -> None:
        self._kill(w)
        if not w.ready:
            self._start_failed(f"did not build the reward within {self.START_TIMEOUT_S:g} s")
            return
        self.restarts += 1
        self._give_up_on_call(w, TIMEOUT, f"the reward call ran past rollout.reward_timeout_s="
                              f"{self.timeout_s:g} s; its worker was killed and replaced", now - w.call_start)

    def _died(self, w: _Worker) -> None:
        self._kill(w)
        code = w.proc.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        if not w.ready:
            self._start_failed(f"{how} (its output is above)")
            return
        self.restarts += 1
        self._give_up_on_call(w, DIED, f"the reward worker {how} during the call; it was replaced",
                              time.monotonic() - w.call_start)
