"""Prompt sets as users keep them: jsonl, parquet (a file, or a folder of shards as `datasets`
writes them), a folder saved by `datasets.Dataset.save_to_disk`, or a list of these; each row
mapped to a record by key paths.

    prompts = open_prompt_set(["data/train.parquet", "data/more.jsonl"], prompt_key="prompt",
                              answer_key="reward_model.ground_truth", cache_dir="runs/a/prompt_cache")
    len(prompts)
    prompts[17]   # {"prompt": [{"role": "user", ...}], "answer": "42", "data_source": "gsm8k", ...}

A record is the row with "prompt" and "answer" set from `prompt_key` and `answer_key` (dotted paths
into nested fields, verl's `reward_model.ground_truth`); every other field of the row stays, so a
reward function or an environment sees `data_source`, `extra_info`, ... The prompt is a non-empty
string or a list of {role, content} chat messages (both go through the tokenizer's chat template).

Large sets are never copied into Python objects whole. Parquet is converted once, batch by batch,
into an Arrow IPC file under `cache_dir` and memory-mapped; `save_to_disk` folders are Arrow files
already and are memory-mapped as they are (datasets.load_from_disk). A row becomes a dict only
when it is asked for. jsonl files are read whole (they are the small, hand-written kind; line
numbers in their errors).

Every bad input is a PromptFileError of one line naming the file, the row and the key: a missing
key (with the keys the row has), a prompt of the wrong type, an unreadable file, a name that is not
a path here (a hub name: no hub access on these machines).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

PARQUET_GLOBS = ("train-*.parquet", "*.parquet")


class PromptFileError(ValueError):
    """A prompt file or one of its records is invalid; the message names file, row and key."""


def _get(row: Any, path: str, where: str) -> Any:
    """row[a][b][c] for path "a.b.c"; PromptFileError naming the key and what the row has."""
    value, done = row, []
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
    prompt, answer = _get(row, prompt_key, where), _get(row, answer_key, where)
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


class ArrowSource:
    """Rows of a memory-mapped Arrow table (parquet converted once, or a save_to_disk folder).
    Parquet is counted and validated from the files themselves, batch by batch: nothing is
    written until a row is read (the driver's cache, under the run's folder)."""

    def __init__(self, path: Path, files: list[Path], table_fn, label: str,
                 parquet: list | None = None) -> None:
        self.path, self._files, self._table_fn, self.label = path, files, table_fn, label
        self._parquet = parquet  # pyarrow ParquetFile per file, for parquet sources
        self._table = None

    @property
    def table(self):
        if self._table is None:
            self._table = self._table_fn()
        return self._table

    def __len__(self) -> int:
        if self._table is None and self._parquet is not None:
            return sum(p.metadata.num_rows for p in self._parquet)
        return self.table.num_rows

    def where(self, i: int) -> str:
        return f"{self.path} row {i}"

    def row(self, i: int) -> dict:
        return self.table.slice(i, 1).to_pylist()[0]

    def files(self) -> list[Path]:
        return list(self._files)

    def validate(self, prompt_key: str, answer_key: str) -> None:
        """Column checks over every row, vectorised (seconds for millions of rows)."""
        if self._table is not None or self._parquet is None:
            validate_table(self.table, prompt_key, answer_key, self.path)
            return
        import pyarrow as pa
        for f, pf in zip(self._files, self._parquet):
            names = pf.schema_arrow.names
            for key in (prompt_key, answer_key):
                if key.split(".")[0] not in names:
                    raise PromptFileError(f"{f} row 0: no key {key!r} (no {key.split('.')[0]!r}; the "
                                          f"rows have {sorted(names)})")
            offset = 0
            for batch in pf.iter_batches(batch_size=8192, columns=sorted(
                    {prompt_key.split(".")[0], answer_key.split(".")[0]})):
                validate_table(pa.Table.from_batches([batch]), prompt_key, answer_key, f, offset)
                offset += batch.num_rows


def validate_table(table, prompt_key: str, answer_key: str, path: Path, offset: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    if table.num_rows == 0:
        return
    for key, is_prompt in ((prompt_key, True), (answer_key, False)):
        col, done = table, []
        for k, part in enumerate(key.split(".")):
            if k and not pa.types.is_struct(col.type):
                raise PromptFileError(f"{path} row {offset}: no key {key!r} ({'.'.join(done)!r} is "
                                      f"{col.type}, not an object)")
            fields = col.schema.names if k == 0 else [f.name for f in col.type]
            if part not in fields:
                at = f" in {'.'.join(done)!r}; it has" if done else "; the rows have"
                raise PromptFileError(f"{path} row {offset}: no key {key!r} (no {part!r}{at} "
                                      f"{sorted(fields)})")
            col = table.column(part) if k == 0 else pc.struct_field(col, part)
            done.append(part)
        nulls = pc.is_null(col)
        if pc.any(nulls).as_py():
            first = pc.index(nulls, True).as_py()
            raise PromptFileError(f"{path} row {offset + first}: {key!r} is null")
        if not is_prompt:
            continue
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            empty = pc.equal(pc.utf8_length(col), 0)
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type) \
                and {"role", "content"} <= {f.name for f in t.value_type}:
            empty = pc.equal(pc.list_value_length(col), 0)
        else:
            raise PromptFileError(f"{path} row {offset}: {key!r} must be a string or a list of "
                                  f"{{'role', 'content'}} messages, the column is {t}")
        if pc.any(empty).as_py():
            raise PromptFileError(f"{path} row {offset + pc.index(empty, True).as_py()}: {key!r} is empty")


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    for pattern in PARQUET_GLOBS:
        found = sorted(path.glob(pattern))
        if found:
            return found
    return []


def _read_parquet_schema_checked(files: list[Path]):
    import pyarrow.parquet as pq
    try:
        # memory-mapped, no read-ahead: a pass holds about one row group's column chunk at a time
        return [pq.ParquetFile(f, memory_map=True, pre_buffer=False) for f in files]
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError kinds
        bad = next((f for f in files if not _readable_parquet(f)), files[0])
        raise PromptFileError(f"{bad}: not a readable parquet file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]})") from None


def _readable_parquet(f: Path) -> bool:
    import pyarrow.parquet as pq
    try:
        pq.ParquetFile(f)
        return True
    except Exception:  # noqa: BLE001
        return False


def _arrow_cache(files: list[Path], cache_dir: Path | None):
    """The parquet files as one memory-mapped Arrow table: converted batch by batch into an Arrow
    IPC file in cache_dir (reused while the files keep their paths, sizes and times), or, without
    a cache_dir, into a temporary file."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    key = hashlib.sha256(json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                                     for f in files]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "gspo-prompt-cache"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{files[0].stem}-{key}.arrow"
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        schema = pq.ParquetFile(files[0]).schema_arrow
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for f in files:
                for batch in pq.ParquetFile(f, memory_map=True, pre_buffer=False).iter_batches(batch_size=8192):
                    writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
        os.replace(tmp, target)
    return pa.ipc.open_file(pa.memory_map(str(target), "r")).read_all()


def open_source(spec: str, cache_dir: str | Path | None) -> JsonlSource | ArrowSource:
    path = Path(spec)
    if not path.exists():
        hub = "/" in spec and not spec.startswith((".", "/")) and len(spec.split("/")) == 2
        why = (" (it looks like a Hugging Face hub name: this machine has no hub access; download "
               "the dataset and give its local path)") if hub else ""
        raise PromptFileError(f"{spec}: no such file or folder{why}")
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        return JsonlSource(path)
    if path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return _saved_dataset(path)
    files = _parquet_files(path)
    if path.is_file() and path.suffix != ".parquet" or not files:
        raise PromptFileError(f"{path}: not a prompt set (expected a .jsonl or .parquet file, a folder "
                              f"of parquet shards, or a folder saved by datasets' save_to_disk)")
    parquet = _read_parquet_schema_checked(files)
    return ArrowSource(path, files, lambda: _arrow_cache(files, cache_dir), "parquet", parquet)


def _saved_dataset(path: Path) -> ArrowSource:
    state = json.loads((path / "state.json").read_text())
    files = [path / "state.json", path / "dataset_info.json"] + [
        path / f["filename"] for f in state.get("_data_files", [])]

    def load():
        import datasets
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001
            raise PromptFileError(f"{path}: not a readable datasets folder ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:120]})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise PromptFileError(f"{path}: a DatasetDict without a 'train' split (has {list(ds)})")
            ds = ds["train"]
        return ds.data.table if hasattr(ds.data, "table") else ds.data
    return ArrowSource(path, files, load, "save_to_disk")


def prompt_set_fingerprint(paths: list[str | Path], records: int) -> dict[str, Any]:
    """The prompt files' resolved paths, total bytes, record count and SHA-256 of their bytes
    (read once, 1 MiB at a time: about a second per GB)."""
    digest, size = hashlib.sha256(), 0
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

    def __getitem__(self, i: int) -> dict:
        source, r = self.locate(i)
        return make_record(source.row(r), self.prompt_key, self.answer_key, source.where(r))

    def prompts(self):
        """(global row, prompt) of every row, reading only the prompt column where it can."""
        for source, start in zip(self.sources, self._starts):
            if isinstance(source, ArrowSource) and "." not in self.prompt_key:
                col = source.table.column(self.prompt_key)
                r = 0
                for chunk in col.chunks:
                    for value in chunk.to_pylist():
                        yield start + r, value
                        r += 1
            else:
                for r in range(len(source)):
                    yield start + r, _get(source.row(r), self.prompt_key, source.where(r))

    def files(self) -> list[Path]:
        return [f for s in self.sources for f in s.files()]

    def with_kept(self, kept) -> "PromptSet":
        return PromptSet(self.sources, self.prompt_key, self.answer_key, kept)


def open_prompt_set(spec: str | list[str], *, prompt_key: str = "prompt", answer_key: str = "answer",
                    cache_dir: str | Path | None = None, validate: bool = True) -> PromptSet:
    specs = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if not specs:
        raise PromptFileError("no prompt sources given")
    sources = [open_source(str(s), cache_dir) for s in specs]
    if validate:
        for s in sources:
            s.validate(prompt_key, answer_key)
    out = PromptSet(sources, prompt_key, answer_key)
    if len(out) == 0:
        raise PromptFileError(f"{', '.join(map(str, specs))}: no records")
    return out
