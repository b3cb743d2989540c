"""A reward worker process: `python -m rollout.rewards.worker_main TASK_FD RESULT_FD PARENT_PID`,
started by RewardWorkerPool (workers.py), never by hand.

It builds the reward once, then scores the tasks the pool sends, one at a time, in its MAIN thread
(so math-verify's signal-based timeouts work here). Each task is one group's responses, from the
first not yet scored:
    pool -> worker   ("init", name, options)                  once
    worker -> pool   ("ready", batched, has_prepare) | ("init_error", message)
    pool -> worker   ("task", task_id, records, texts)
    worker -> pool   ("prepared", task_id)                    after each prompt's prepare()
                     ("score", task_id, i, reward, error, seconds, status)   per response, or for batched:
                     ("batch", task_id, [(reward, error), ...], seconds)
Every message restarts the pool's clock for the call that follows, so the time bound is per call.
Frames are an 8-byte length then a pickle. The worker's stdout goes to stderr: a print in a reward
function must not reach the pipe.

The worker dies with its parent (PR_SET_PDEATHSIG), and runs in a session of its own, so a signal
meant for the trainer's process group (Ctrl-C, a Slurm step's SIGTERM) reaches the trainer, which
decides, and not the worker in the middle of a call. It is not dumpable (PR_SET_DUMPABLE 0): a
process of the same user (a program of the code sandbox in process mode) cannot read its memory
(the tests' expected outputs), environment or file descriptors through /proc, nor trace it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Any

from rollout.rewards.frames import recv, send

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent goes (Linux); exit now if it has gone already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def not_dumpable() -> None:
    """/proc/<this pid>/{mem,environ,fd,maps} and ptrace: root's only (module docstring)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def score_task(reward: Any, task_id: int, records: list[dict], texts: list[str], result_fd: int) -> None:
    """Score one task, sending a message per prepared prompt and per response (module docstring)."""
    from rollout.rewards.scoring import OK, as_reward, error_text, status_of
    if reward.batched:
        t0 = time.perf_counter()
        try:
            values = list(reward.score(records, texts))
            if len(values) != len(texts):
                raise ValueError(f"returned {len(values)} values for {len(texts)} responses")
            results: list[tuple[float, str | None]] = []
            for v in values:
                try:
                    results.append((as_reward(v), None))
                except ValueError as e:
                    results.append((0.0, error_text(e)))
        except Exception as e:  # noqa: BLE001 - counted by the pool's caller, not fatal here
            results = [(0.0, error_text(e))] * len(texts)
        send(result_fd, ("batch", task_id, results, time.perf_counter() - t0))
        return
    prepared: dict[int, tuple[Any, str | None]] = {}  # id(record) -> (prepared, error): once per prompt
    for i, (record, text) in enumerate(zip(records, texts)):
        t0 = time.perf_counter()
        result: tuple[float, str | None]
        if reward.prepare is not None and id(record) not in prepared:
            try:
                prepared[id(record)] = (reward.prepare(record), None)
            except Exception as e:  # noqa: BLE001
                prepared[id(record)] = (None, error_text(e))
            send(result_fd, ("prepared", task_id))
            t0 = time.perf_counter()
        try:
            if reward.prepare is not None:
                value, error = prepared[id(record)]
                if error is not None:
                    raise RuntimeError(f"preparing the prompt's reference failed: {error}")
                result = (as_reward(reward.score(record, text, value)), None)
            else:
                result = (as_reward(reward.score(record, text)), None)
            status = OK
        except Exception as e:  # noqa: BLE001
            result, status = (0.0, error_text(e)), status_of(e)
        send(result_fd, ("score", task_id, i, result[0], result[1], time.perf_counter() - t0, status))


def main(argv: list[str]) -> int:
    task_fd, result_fd, parent_pid = int(argv[0]), int(argv[1]), int(argv[2])
    die_with_parent(parent_pid)
    not_dumpable()
    os.dup2(2, 1)  # print() in a reward function goes to stderr, never into the result pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops its workers itself
    message = recv(task_fd)
    if message is None:
        return 0
    _, name, args, timeout_s, plugins = message
    try:
        from gspo_tables import import_plugins
        from rollout.rewards.registry import get_reward
        import_plugins(plugins)  # the run's plug-in modules register their rows here too
        reward = get_reward(name, args, reward_timeout_s=timeout_s)
        if reward.warm is not None:
            reward.warm()
    except Exception as e:  # noqa: BLE001 - reported to the pool, which names it in one line
        send(result_fd, ("init_error", f"{type(e).__name__}: {e}"))
        return 1
    send(result_fd, ("ready", reward.batched, reward.prepare is not None))
    while True:
        message = recv(task_fd)
        if message is None:
            return 0
        _, task_id, records, texts = message
        score_task(reward, task_id, records, texts, result_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
