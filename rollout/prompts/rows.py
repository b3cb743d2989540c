"""Rows of a prompt set made into records, and the jsonl source (rollout/prompts/sets.py reads
every kind of set; rollout/prompts/arrow.py the parquet and save_to_disk ones).

    record = make_record(row, "prompt", "reward_model.ground_truth", where="train.jsonl:3")

A record is the row with "prompt" and "answer" set from their key paths, every other field kept.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gspo_errors import InputError


class PromptFileError(InputError, ValueError):
    """A prompt file or one of its records is invalid; the message names file, row and key."""


def resolved(path: str | Path) -> str:
    """A path for an error message: as given, and where a relative one points (config paths are
    relative to the working directory, not to the config file)."""
    p = Path(path)
    return f"{str(path)!r}" if p.is_absolute() else f"{str(path)!r} (= {Path.cwd() / p}, relative to the working directory)"


def get_key(row: Any, path: str, where: str) -> Any:
    """row[a][b][c] for path "a.b.c"; PromptFileError naming the key and what the row has."""
    value, done = row, list[str]()
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            at = f" in {'.'.join(done)!r}" if done else ""
            raise PromptFileError(f"{where}: no key {path!r} (no {part!r}{at}; the row has {have})")
        value, done = value[part], done + [part]
    return value


def _is_messages(x: Any) -> bool:
    return (isinstance(x, list) and len(x) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in x))


def make_record(row: dict, prompt_key: str, answer_key: str, where: str) -> dict:
    """The row with "prompt" and "answer" taken from their key paths (the rest kept)."""
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected an object, got {type(row).__name__}")
    prompt, answer = get_key(row, prompt_key, where), get_key(row, answer_key, where)
    if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
        raise PromptFileError(f"{where}: {prompt_key!r} must be a non-empty string or a list of "
                              f"{{'role', 'content'}} messages, got {prompt!r:.80}")
    if answer is None:
        raise PromptFileError(f"{where}: {answer_key!r} is null")
    return {**row, "prompt": prompt, "answer": answer}


# --- one source ---------------------------------------------------------------------------------
class JsonlSource:
    """A jsonl file, read whole: one JSON object per non-empty line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            lines = path.read_text(encoding="utf-8-sig").split("\n")  # a leading BOM is not JSON
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{path}: not UTF-8 text ({e.reason} at byte offset {e.start})") from None
        self.rows, self.lines = [], []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                # Column in characters of the line, with the text around it (unambiguous whatever
                # an editor counts).
                text = line.rstrip("\r\n")
                near = f"{text[max(0, e.pos - 25):e.pos]}>>>{text[e.pos:e.pos + 10]}"
                raise PromptFileError(f"{path}:{lineno}: not valid JSON: {e.msg} at character "
                                      f"{e.pos + 1} of the line, here: {near!r}") from None
            self.lines.append(lineno)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"

    def row(self, i: int) -> dict:
        return self.rows[i]

    def files(self) -> list[Path]:
        return [self.path]

    def validate(self, prompt_key: str, answer_key: str) -> None:
        for i, row in enumerate(self.rows):
            make_record(row, prompt_key, answer_key, self.where(i))

    def values(self, key: str):
        """The value at `key` of every row, in order."""
        for i, row in enumerate(self.rows):
            yield get_key(row, key, self.where(i))
