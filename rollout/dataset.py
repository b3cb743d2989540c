"""Prompt datasets: jsonl files with "prompt" and "answer" fields, and a resumable prompt stream.

    records = load_prompts("data/gsm8k.jsonl")         # [{"prompt": ..., "answer": ..., ...}]
    stream = PromptStream(records, seed=0)             # endless, reshuffled each epoch
    ids = chat_prompt_ids(tokenizer, records[0])       # chat template + generation prompt
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

REQUIRED_FIELDS = ("prompt", "answer")


class PromptFileError(ValueError):
    """A prompt file or one of its records is invalid; the message names file and line."""


def load_prompts(path: str | Path, required: tuple[str, ...] = REQUIRED_FIELDS) -> list[dict]:
    """Read a jsonl file: one JSON object per non-empty line, each with the `required` fields
    ("prompt": a string or a list of chat messages; "answer": anything JSON)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")  # a leading BOM is not JSON
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not UTF-8 text ({e.reason} at byte offset {e.start})") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            # Column in characters of the line (not bytes), with the text around it: the
            # position is then unambiguous whatever the editor counts.
            text = line.rstrip("\r\n")
            near = f"{text[max(0, e.pos - 25):e.pos]}>>>{text[e.pos:e.pos + 10]}"
            raise PromptFileError(f"{where}: not valid JSON: {e.msg} at character {e.pos + 1} "
                                  f"of the line, here: {near!r}") from None
        if not isinstance(rec, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in required if k not in rec]
        if missing:
            raise PromptFileError(f"{where}: missing field(s) {missing}; has {sorted(rec)}")
        prompt = rec.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string or a list of "
                                  f"{{'role', 'content'}} messages, got {prompt!r:.80}")
        records.append(rec)
    if not records:
        raise PromptFileError(f"{path}: no records")
    return records


def _is_messages(x: Any) -> bool:
    return (isinstance(x, list) and len(x) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in x))


def chat_prompt_ids(tokenizer: Any, record: dict, system: str | None = None) -> list[int]:
    """Token ids of the record's prompt through the tokenizer's chat template, ending with the
    assistant generation prompt. A string prompt becomes one user message."""
    prompt = record["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class PromptStream:
    """Endless iterator over records, reshuffled each epoch with a seeded RNG; its position is
    plain data (to_state/load_state) so a resumed run sees the same prompts in the same order."""

    def __init__(self, records: list[dict], seed: int = 0, shuffle: bool = True):
        if not records:
            raise ValueError("PromptStream needs at least one record")
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        rec = self.records[self._order[self.position]]
        self.position += 1
        return rec

    def to_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"PromptStream state has seed {state['seed']}, this stream {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
