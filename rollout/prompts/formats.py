"""The table of prompt formats: what a path of `rollout.prompts` is read as.

    fmt = PROMPT_FORMATS.row("jsonl")            # PromptFormat
    fmt = format_for(Path("data/train.parquet"))  # the first row that claims the path
    source = fmt.open(path, cache_dir)           # a PromptSource (below)

A row says which paths it claims (`claims(path)`, asked in the table's order when
`rollout.prompt_format` is null) and opens one as a `PromptSource`: the rows of one file or folder,
read lazily. A format from outside the package is a PromptFormat in an installed module
(`rollout.prompt_format: my_pkg.prompts:CSV`), or registered by a `plugins:` module, after which
the paths it claims are found by their shape like the shipped ones.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gspo_tables import Table
from rollout.prompts.arrow import open_parquet, parquet_files, saved_dataset
from rollout.prompts.rows import JsonlSource, PromptFileError


@runtime_checkable
class PromptSource(Protocol):
    """The rows of one prompt file or folder (rows.py JsonlSource and arrow.py ArrowSource are two)."""

    def __len__(self) -> int: ...

    def row(self, i: int) -> dict[str, Any]:
        """Row i as a dict (every field as the file has it)."""

    def where(self, i: int) -> str:
        """Where row i is, for messages ("data.jsonl:17", "train.parquet row 16")."""

    def files(self) -> list[Path]:
        """The files the rows come from (their bytes make the set's fingerprint)."""

    def validate(self, prompt_key: str, answer_key: str) -> None:
        """Every row has a usable prompt and answer at the keys: else PromptFileError naming the row."""

    def values(self, key: str) -> Iterator[Any]:
        """The value at `key` of every row, in order (reading only that column where it can)."""


@dataclass(frozen=True)
class PromptFormat:
    """One row of PROMPT_FORMATS."""

    name: str
    claims: Callable[[Path], bool]
    """Whether a path (that exists) is of this format: asked in the table's order."""
    open: Callable[[Path, Path | None], PromptSource]
    """(path, cache_dir) -> its rows; PromptFileError names the file and what is wrong."""
    description: str


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _is_dataset_dict(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_dict.json").is_file()


def _refuse_dataset_dict(path: Path, cache_dir: Path | None) -> PromptSource:
    """A DatasetDict (one folder per split) is not one set: name the splits to choose from."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
    except (OSError, ValueError):
        splits = []
    splits = [s for s in splits if (path / s / "state.json").is_file()] or sorted(
        d.name for d in path.iterdir() if (d / "state.json").is_file())
    raise PromptFileError(f"{path}: a DatasetDict saved by save_to_disk, with the splits {splits}: give "
                          f"one split's folder, e.g. {path / (splits[0] if splits else 'train')}")


def _is_parquet(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".parquet") or (path.is_dir() and bool(parquet_files(path)))


PROMPT_FORMATS: Table[PromptFormat] = Table("prompt format", PromptFormat, (
    PromptFormat("jsonl", lambda p: p.is_file() and p.suffix in (".jsonl", ".json"),
                 lambda p, cache: JsonlSource(p), "a .jsonl file: one JSON object per line, read whole"),
    PromptFormat("save_to_disk", _is_saved_dataset, lambda p, cache: saved_dataset(p),
                 "a folder saved by datasets' save_to_disk, memory-mapped"),
    PromptFormat("dataset_dict", _is_dataset_dict, _refuse_dataset_dict,
                 "a DatasetDict folder: refused, naming its splits (give one split's folder)"),
    PromptFormat("parquet", _is_parquet, lambda p, cache: open_parquet(p, parquet_files(p), cache),
                 "a .parquet file or a folder of shards, converted once to Arrow and memory-mapped"),
), field="rollout.prompt_format")


def format_for(path: Path, name: str | None = None) -> PromptFormat:
    """The format `name` names, or (None) the first row of PROMPT_FORMATS that claims `path`."""
    if name is not None:
        return PROMPT_FORMATS.row(name, "rollout.prompt_format")
    for fmt in PROMPT_FORMATS.values():
        if fmt.claims(path):
            return fmt
    raise PromptFileError(f"{path}: not a prompt set (expected {'; '.join(PROMPT_FORMATS.choices().values())}; "
                          "or rollout.prompt_format naming a format of your own)")
