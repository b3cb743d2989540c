"""Prompt sets as users keep them: a path, or a list of paths, each read by a row of PROMPT_FORMATS
(formats.py: jsonl, parquet and datasets' folders ship); each row mapped to a record by key paths.

    prompts = open_prompt_set(["data/train.parquet", "data/more.jsonl"], prompt_key="prompt",
                              answer_key="reward_model.ground_truth", cache_dir="runs/a/prompt_cache")
    len(prompts)
    prompts[17]   # {"prompt": [{"role": "user", ...}], "answer": "42", "data_source": "gsm8k", ...}

A record is the row with "prompt" and "answer" set from `prompt_key` and `answer_key` (dotted paths
into nested fields, verl's `reward_model.ground_truth`); every other field of the row stays, so a
reward function or an environment sees `data_source`, `extra_info`, ... The prompt is a non-empty
string or a list of {role, content} chat messages (both go through the tokenizer's chat template).

What a path is read as is a row of PROMPT_FORMATS (formats.py), chosen by the path's shape or by
rollout.prompt_format. Large sets are never copied into Python objects whole: parquet is converted once, batch by
batch, into an Arrow IPC file under `cache_dir` and memory-mapped; `save_to_disk` folders are
Arrow files already and are memory-mapped as they are (rollout/prompts/arrow.py). A row becomes a
dict only when it is asked for. jsonl files are read whole (they are the small, hand-written
kind; line numbers in their errors).

Every bad input is a PromptFileError of one line naming the file, the row and the key: a missing
key (with the keys the row has), a prompt of the wrong type, an unreadable file, a name that is not
a path here (a hub name: no hub access on these machines).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from rollout.prompts.formats import PromptSource, format_for
from rollout.prompts.rows import PromptFileError, make_record, resolved  # noqa: F401  (PromptFileError: the API)


def open_source(spec: str, cache_dir: str | Path | None, prompt_format: str | None = None) -> PromptSource:
    """The rows of one path, as its format reads them (formats.py: `prompt_format`, or the first
    format of PROMPT_FORMATS that claims the path)."""
    path = Path(spec)
    if not path.exists():
        hub = "/" in spec and not spec.startswith((".", "/")) and len(spec.split("/")) == 2
        why = (" (it looks like a Hugging Face hub name: this machine has no hub access; download "
               "the dataset and give its local path)") if hub else ""
        raise PromptFileError(f"{resolved(spec)}: no such file or folder{why}")
    return format_for(path, prompt_format).open(path, Path(cache_dir) if cache_dir is not None else None)


def prompt_set_fingerprint(paths: Sequence[str | Path], records: int,
                           selection: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prompt files' resolved paths, total bytes, row count and SHA-256 of their bytes (read
    once, 1 MiB at a time: about a second per GB) and of `selection` (the keys and filters that
    make records of the rows: another selection is another set)."""
    digest, size = hashlib.sha256(json.dumps(selection or {}, sort_keys=True).encode()), 0
    for p in paths:
        digest.update(f"{Path(p).stat().st_size}\0".encode())  # file boundaries, not names: a moved set is the same
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
                size += len(chunk)
    return {"paths": [str(Path(p).resolve()) for p in paths], "bytes": size, "records": records,
            "sha256": digest.hexdigest()}


# --- the set ------------------------------------------------------------------------------------
class PromptSet(Sequence):
    """The rows of one or more sources, in order, as records (make_record); `kept` selects rows
    (the long-prompt filter) without copying any."""

    def __init__(self, sources: list, prompt_key: str, answer_key: str, kept=None) -> None:
        self.sources, self.prompt_key, self.answer_key = sources, prompt_key, answer_key
        self.kept = kept
        self._starts = []
        n = 0
        for s in sources:
            self._starts.append(n)
            n += len(s)
        self._rows = n

    @property
    def total_rows(self) -> int:
        return self._rows

    def __len__(self) -> int:
        return self._rows if self.kept is None else len(self.kept)

    def locate(self, i: int):
        """(source, row in it) of record i."""
        import bisect
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = int(self.kept[i]) if self.kept is not None else i
        k = bisect.bisect_right(self._starts, g) - 1
        return self.sources[k], g - self._starts[k]

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]  # rows by index; no slices
        source, r = self.locate(i)
        return make_record(source.row(r), self.prompt_key, self.answer_key, source.where(r))

    def prompts(self):
        """(global row, prompt) of every row, reading only the prompt column where it can."""
        for source, start in zip(self.sources, self._starts):
            for r, value in enumerate(source.values(self.prompt_key)):
                yield start + r, value

    def files(self) -> list[Path]:
        return [f for s in self.sources for f in s.files()]

    def with_kept(self, kept) -> "PromptSet":
        return PromptSet(self.sources, self.prompt_key, self.answer_key, kept)


def open_prompt_set(spec: str | list[str], *, prompt_key: str = "prompt", answer_key: str = "answer",
                    cache_dir: str | Path | None = None, validate: bool = True,
                    prompt_format: str | None = None) -> PromptSet:
    specs = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if not specs:
        raise PromptFileError("no prompt sources given")
    sources = [open_source(str(s), cache_dir, prompt_format) for s in specs]
    if validate:
        for s in sources:
            s.validate(prompt_key, answer_key)
    out = PromptSet(sources, prompt_key, answer_key)
    if len(out) == 0:
        raise PromptFileError(f"{', '.join(map(str, specs))}: no records")
    return out
