"""Reward functions of the tests' own, run in reward workers (rollout.reward=reward_functions:NAME;
tests/ is on the workers' import path). Each misbehaves on responses that ask for it."""
from __future__ import annotations

import ctypes
import os
import time

from rollout.rewards import batched


def misbehaving(record: dict, response_text: str) -> float:
    """1.0, unless the response (or, for the runs' tests, the record's "misbehave" field) says
    hang / exit / segfault / nan / inf / string / raise."""
    how = record.get("misbehave") or response_text
    if "hang" in how:
        time.sleep(10 ** 6)
    if "exit" in how:
        os._exit(3)
    if "segfault" in how:
        ctypes.string_at(0)
    if "nan" in how:
        return float("nan")
    if "inf" in how:
        return float("inf")
    if "string" in how:
        return "high"  # type: ignore[return-value]
    if "raise" in how:
        raise KeyError("no such thing")
    return 1.0


def by_call_number(record: dict, response_text: str) -> float:
    """For a run: the k-th call of the run (a counter in the file $GSPO_TEST_REWARD_COUNTER, shared
    by the workers and their replacements) hangs when k % 5 == 0, exits its worker when k % 7 == 0,
    returns NaN when k % 11 == 0 and raises when k % 13 == 0 (the first rule that applies); the
    others score by the response's length (so advantages are not all zero)."""
    import fcntl
    with open(os.environ["GSPO_TEST_REWARD_COUNTER"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = int(f.read() or 0) + 1
        f.seek(0)
        f.truncate()
        f.write(str(k))
    if k % 5 == 0:
        time.sleep(10 ** 6)
    if k % 7 == 0:
        os._exit(3)
    if k % 11 == 0:
        return float("nan")
    if k % 13 == 0:
        raise KeyError("thirteen")
    return float(len(response_text) % 3)


_PREPARED = 0


def counting(record: dict, response_text: str, prepared: int) -> float:
    """The number of prepare() calls this worker had made when it prepared this prompt."""
    return float(prepared)


def _count(record: dict) -> int:
    global _PREPARED
    _PREPARED += 1
    return _PREPARED


counting.prepare = _count  # type: ignore[attr-defined]


@batched
def lengths(records: list[dict], texts: list[str]) -> list[float]:
    """A batched reward: one call per group."""
    return [float(len(t)) for t in texts]


@batched
def wrong_length(records: list[dict], texts: list[str]) -> list[float]:
    return [1.0]


def hangs_when_flagged(record: dict, response_text: str) -> float:
    """Scores by the response's length until the file $GSPO_TEST_HANG_FLAG exists; from then on
    every call writes "<flag>.hanging" and hangs (a reward stuck for good, for the signal tests)."""
    flag = os.environ["GSPO_TEST_HANG_FLAG"]
    if os.path.exists(flag):
        with open(flag + ".hanging", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(10 ** 6)
    return float(len(response_text) % 3)
