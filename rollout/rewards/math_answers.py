"""`reward: math`: math-verify's symbolic equivalence of the response's final answer and the row's.

The reference ("gold") answer is stored differently by every dataset; math-verify extracts an answer
from LaTeX only when it is delimited (`$...$`, `\\(...\\)`, `\\[...\\]`) or boxed. So the gold is
put in the form math-verify expects before parsing, the same way for every layout:
    MATH, MATH-500, DAPO, verl's parquet   `2\\sqrt{3}`, `\\dfrac{3}{4}`, `(1, 2]`   -> `$...$`
    already delimited or boxed              `$\\pi$`, `\\boxed{5}`                  -> as it is
    GSM8K's raw solution                    `... #### 72`                           -> `$72$`
    numbers (AIME, GSM8K answers)           `33`, 0.5                               -> `$33$`
(before, a gold with a backslash but no `$` was parsed as it was: `2\\sqrt{3}` extracted `2`, and
`\\sqrt{2}` nothing at all). The gold is parsed once per prompt (`prepare`), not once per sample.

Timeouts: math-verify's own (`parsing_timeout`, `timeout_seconds`) use SIGALRM, so they work only in
a process's main thread, which is where the reward workers call this (rollout/rewards/workers.py);
elsewhere they are off. Either way the hard bound is the worker's: a call that runs past
rollout.reward_timeout_s is killed with its process (sympy can compute for minutes inside one C call
with the GIL held, e.g. on `9^{9^{9^{9}}}`, where no signal handler runs).
"""
from __future__ import annotations

import threading
from typing import Any

SIGNAL_TIMEOUT_S = 5
"""math-verify's own timeout per parse and per comparison, where signals work (main thread)."""


def delimit_gold(gold: Any) -> str:
    """The reference answer as math-verify parses it: delimited LaTeX, or boxed (module docstring)."""
    text = str(gold).strip()
    if "####" in text:  # GSM8K keeps the final answer after "####"
        text = text.rsplit("####", 1)[1].strip()
    if "\\boxed" in text or "$" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _timeout() -> int | None:
    return SIGNAL_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def prepare_gold(record: dict) -> list:
    """The parsed reference answer of a prompt row (once per prompt); ValueError when math-verify
    extracts nothing from it."""
    from math_verify import parse

    gold_text = delimit_gold(record["answer"])
    gold = parse(gold_text, parsing_timeout=_timeout())
    if not gold:
        raise ValueError(f"math-verify could not parse the reference answer {record['answer']!r} "
                         f"(as {gold_text!r})")
    return gold


def score_math(record: dict, response_text: str, gold: list | None = None) -> float:
    """1.0 when math-verify finds the response's final answer equal to the gold (symbolically:
    1/2 == 0.5 == \\frac{1}{2}), else 0.0."""
    from math_verify import parse, verify

    if gold is None:
        gold = prepare_gold(record)
    timeout = _timeout()
    pred = parse(response_text, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


def math_reward(record: dict, response_text: str) -> float:
    """One sample, gold parsed here: `fn(record, text)` like any reward function."""
    return score_math(record, response_text)
