"""Rewards that read a final answer out of a response: exact match, format, weighted sums.

A reward function is `fn(prompt_record: dict, response_text: str) -> float`; the record is the
prompt's row ("answer" is the field the answer key mapped, every other field of the row kept).
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

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


def format_reward(pattern: str = r"(?s).*\\boxed\{.+\}.*") -> RewardFn:
    """1.0 when the whole response matches the regex `pattern` (default: contains a \\boxed{})."""
    regex = re.compile(pattern)
    return lambda record, response_text: float(regex.fullmatch(response_text) is not None)


def weighted_sum(terms: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """sum_i w_i * fn_i(record, text); e.g. [(math_reward, 1.0), (format_reward(), 0.1)]."""
    return lambda record, response_text: sum(w * fn(record, response_text) for fn, w in terms)
