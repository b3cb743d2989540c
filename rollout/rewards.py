"""Reward functions for verifiable tasks, and the error accounting around them.

A reward function is `fn(prompt_record: dict, response_text: str) -> float`; the record is the
prompt's jsonl row (its "answer" field for the checkers here). `score_sample` runs one and records
an exception on the sample instead of propagating it; `RewardErrorBudget` fails the run only when
the fraction of failed reward calls exceeds a configured limit.
"""
from __future__ import annotations

import importlib
import re
import threading
from typing import Any, Callable, Sequence

from rollout.sample import Sample

RewardFn = Callable[[dict, str], float]

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: last \\boxed{...}, else the text after the last "answer is" / "Answer:"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    m = list(re.finditer(r"(?:answer is|answer:)\s*(.+)", text, flags=re.IGNORECASE))
    if m:
        return m[-1].group(1).strip().rstrip(".").strip()
    return None


def _normalize(s: str) -> str:
    s = s.strip().rstrip(".").replace(" ", "").replace("$", "")
    return s.lower()


def exact_match_reward(record: dict, response_text: str) -> float:
    """1.0 when the extracted answer equals record["answer"] after whitespace/$/case normalisation."""
    pred = extract_answer(response_text)
    return float(pred is not None and _normalize(pred) == _normalize(str(record["answer"])))


def math_reward(record: dict, response_text: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to record["answer"]
    (symbolic: 1/2 == 0.5 == \\frac{1}{2}). Uses signal-based timeouts in the main thread only
    (math-verify's mechanism cannot run elsewhere)."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = str(record["answer"])
    gold = parse(gold_text if "$" in gold_text or "\\" in gold_text else f"${gold_text}$",
                 parsing_timeout=timeout)
    pred = parse(response_text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the reference answer {gold_text!r}")
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


def format_reward(pattern: str = r"(?s).*\\boxed\{.+\}.*") -> RewardFn:
    """1.0 when the whole response matches the regex `pattern` (default: contains a \\boxed{})."""
    regex = re.compile(pattern)
    return lambda record, response_text: float(regex.fullmatch(response_text) is not None)


def weighted_sum(terms: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """sum_i w_i * fn_i(record, text); e.g. [(math_reward, 1.0), (format_reward(), 0.1)]."""
    return lambda record, response_text: sum(w * fn(record, response_text) for fn, w in terms)


REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward,
                                "format": format_reward()}


class RewardSpecError(ValueError):
    """rollout.reward names nothing that can be called; the message says why."""


def get_reward_fn(name: str) -> RewardFn:
    """A shipped reward by name, or your own as `package.module:function`: fn(record, response_text)
    -> float, where `record` is the prompt row (its "prompt", "answer" and every other field of the
    row: data_source, extra_info, ...)."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise RewardSpecError(f"rollout.reward={name!r}: {type(e).__name__}: {e}") from None
        if not callable(fn):
            raise RewardSpecError(f"rollout.reward={name!r}: {attr} is not callable")
        return fn
    raise RewardSpecError(f"unknown reward {name!r}; expected one of {sorted(REWARDS)} or "
                          "package.module:function")


def score_sample(sample: Sample, fn: RewardFn, response_text: str) -> bool:
    """Set sample.reward = fn(...); on an exception set reward 0.0 and record it in
    sample.reward_error. Returns False when it raised."""
    try:
        sample.reward = float(fn(sample.prompt, response_text))
        sample.reward_error = None
        return True
    except Exception as e:  # noqa: BLE001 - a buggy reward must not kill a long run; it is counted
        sample.reward = 0.0
        sample.reward_error = f"{type(e).__name__}: {e}"
        return False


class RewardErrorBudgetExceeded(RuntimeError):
    pass


class RewardErrorBudget:
    """Counts reward calls and failures over the run; raises past `max_error_fraction`
    (checked once at least `min_calls` calls were made, so one early failure does not end a run)."""

    def __init__(self, max_error_fraction: float = 0.0, min_calls: int = 1):
        self.max_error_fraction, self.min_calls = max_error_fraction, min_calls
        self.calls = 0
        self.errors = 0
        self.last_error: str | None = None

    def record(self, ok: bool, error: str | None = None) -> None:
        self.calls += 1
        if not ok:
            self.errors += 1
            self.last_error = error
        if (self.calls >= self.min_calls
                and self.errors > self.max_error_fraction * self.calls):
            raise RewardErrorBudgetExceeded(
                f"reward function (or environment) failed {self.errors} of {self.calls} times "
                f"(> max_error_fraction {self.max_error_fraction}); last error: {self.last_error}")

    def to_state(self) -> dict[str, Any]:
        return {"calls": self.calls, "errors": self.errors, "last_error": self.last_error}

    def load_state(self, state: dict[str, Any]) -> None:
        self.calls, self.errors, self.last_error = state["calls"], state["errors"], state["last_error"]
