"""Prompt datasets: a prompt set (rollout/prompts/sets.py), a resumable prompt stream over it, and
chat-template prompt ids.

    records = load_prompts("data/gsm8k.jsonl")         # a PromptSet: records[i] = {"prompt", "answer", ...}
    stream = PromptStream(records, seed=0)             # endless, reshuffled each epoch
    ids = chat_prompt_ids(tokenizer, records[0])       # chat template + generation prompt
"""
from __future__ import annotations

import array
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TypeAlias

from rollout.prompts.sets import PromptFileError, PromptSet, open_prompt_set  # noqa: F401  (PromptFileError: the API)

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

KeptRows: TypeAlias = "NDArray[np.int64]"  # the rows of a prompt set that filter_overlong keeps, in order


def load_prompts(spec: str | Path | list, prompt_key: str = "prompt", answer_key: str = "answer",
                 cache_dir: str | Path | None = None, prompt_format: str | None = None) -> PromptSet:
    """A prompt set (rollout.prompts.sets): a path or a list of paths, each read as a row of
    PROMPT_FORMATS (by its shape, or `prompt_format` by name); every row validated (PromptFileError names file, row and key),
    records made on access ("prompt": a string or a list of chat messages; "answer": anything)."""
    return open_prompt_set(spec if isinstance(spec, list) else str(spec), prompt_key=prompt_key,
                           answer_key=answer_key, cache_dir=cache_dir, prompt_format=prompt_format)


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


def filter_overlong(prompts: PromptSet, tokenizer: Any, max_tokens: int) -> tuple[PromptSet, int]:
    """The set without prompts longer than `max_tokens` through the chat template (verl's
    filter_overlong_prompts), and how many were dropped; the rows are not copied (a kept-index
    array, 8 bytes a row). PromptFileError when none is left."""
    import numpy as np
    kept = np.fromiter((i for i, prompt in prompts.prompts()
                        if len(chat_prompt_ids(tokenizer, {"prompt": prompt})) <= max_tokens), dtype=np.int64)
    dropped = prompts.total_rows - len(kept)
    if len(kept) == 0:
        raise PromptFileError(f"every one of the {prompts.total_rows} prompts is longer than "
                              f"{max_tokens} tokens (max_prompt_tokens): nothing left to train on")
    return prompts.with_kept(kept), dropped


class PromptStream:
    """Endless iterator over records, reshuffled each epoch with a seeded RNG; its position is
    plain data (to_state/load_state) so a resumed run sees the same prompts in the same order."""

    def __init__(self, records: Sequence[dict], seed: int = 0, shuffle: bool = True):
        if not records:
            raise ValueError("PromptStream needs at least one record")
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> array.array:
        # A compact array of int64 (8 bytes a prompt, 38 MB less than a list for a million rows);
        # random.shuffle makes the same swaps on it as on a list: the same order as ever.
        order = array.array("q", range(len(self.records)))
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
