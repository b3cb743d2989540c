"""Parquet files and `datasets.save_to_disk` folders as prompt sources (rollout/prompts/sets.py):
validated column by column from the files, rows read from a memory-mapped Arrow IPC cache.

A parquet set is converted once, batch by batch, into an Arrow IPC file of 64-row record batches
under the run's cache folder (with the batch sizes beside it, `.rows.npy`), and memory-mapped: a
row becomes a dict only when it is asked for, and a million-row set stays under 300 MB resident
(benchmarks/data.py). A save_to_disk folder is Arrow already and is memory-mapped as it is.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rollout.prompts.rows import PromptFileError, get_key

PARQUET_GLOBS = ("train-*.parquet", "*.parquet")


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
        table = self.table
        if isinstance(table, IpcRows):
            return table.row(i)
        return table.slice(i, 1).to_pylist()[0]

    def files(self) -> list[Path]:
        return list(self._files)

    def validate(self, prompt_key: str, answer_key: str) -> None:
        """Column checks over every row, vectorised (seconds for millions of rows)."""
        if self._parquet is None:  # a save_to_disk folder: its memory-mapped table
            validate_table(self.table, prompt_key, answer_key, self.path)
            return
        import pyarrow as pa
        for f, pf in zip(self._files, self._parquet):
            check_schema(pf.schema_arrow, prompt_key, answer_key, f)
            messages = not _is_string(_key_type(pf.schema_arrow, prompt_key, f))
            columns = _leaves(pf, prompt_key, messages) + _leaves(pf, answer_key, False)
            offset = 0
            for batch in pf.iter_batches(batch_size=8192, columns=columns):
                check_rows(pa.Table.from_batches([batch]), prompt_key, answer_key, f, offset)
                offset += batch.num_rows

    def values(self, key: str):
        """The value at `key` of every row, in order; a top-level column is read by itself."""
        if "." in key:
            for r in range(len(self)):
                yield get_key(self.row(r), key, self.where(r))
            return
        table = self.table
        chunks = table.column_chunks(key) if isinstance(table, IpcRows) else table.column(key).chunks
        for chunk in chunks:
            yield from chunk.to_pylist()


def _key_type(schema, key: str, path: Path):
    """The Arrow type at a dotted key of a schema; PromptFileError naming what the rows have."""
    import pyarrow as pa
    fields, done, t = {f.name: f.type for f in schema}, list[str](), None
    for part in key.split("."):
        if t is not None:
            if not pa.types.is_struct(t):
                raise PromptFileError(f"{path} row 0: no key {key!r} ({'.'.join(done)!r} is {t}, not an object)")
            fields = {f.name: f.type for f in t}
        if part not in fields:
            at = f" in {'.'.join(done)!r}; it has" if done else "; the rows have"
            raise PromptFileError(f"{path} row 0: no key {key!r} (no {part!r}{at} {sorted(fields)})")
        t = fields[part]
        done.append(part)
    return t


def _is_string(t) -> bool:
    import pyarrow as pa
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def check_schema(schema, prompt_key: str, answer_key: str, path: Path) -> None:
    """Both keys exist, and the prompt is a string or a list of {role, content} messages."""
    import pyarrow as pa
    t = _key_type(schema, prompt_key, path)
    messages = ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type)
                and {"role", "content"} <= {f.name for f in t.value_type})
    if not (_is_string(t) or messages):
        raise PromptFileError(f"{path} row 0: {prompt_key!r} must be a string or a list of "
                              f"{{'role', 'content'}} messages, the column is {t}")
    _key_type(schema, answer_key, path)


def check_rows(table, prompt_key: str, answer_key: str, path: Path, offset: int = 0) -> None:
    """No row has a null prompt or answer, or an empty prompt (string or message list). The prompt
    column may hold the message lists without their content (check_schema checked the type)."""
    import pyarrow.compute as pc
    for key, is_prompt in ((prompt_key, True), (answer_key, False)):
        parts = key.split(".")
        col = table.column(parts[0])
        for part in parts[1:]:
            col = pc.struct_field(col, part)
        nulls = pc.is_null(col)
        if pc.any(nulls).as_py():
            raise PromptFileError(f"{path} row {offset + pc.index(nulls, True).as_py()}: {key!r} is null")
        if is_prompt:
            empty = pc.equal(pc.utf8_length(col) if _is_string(col.type) else pc.list_value_length(col), 0)
            if pc.any(empty).as_py():
                raise PromptFileError(f"{path} row {offset + pc.index(empty, True).as_py()}: {key!r} is empty")


def validate_table(table, prompt_key: str, answer_key: str, path: Path, offset: int = 0) -> None:
    check_schema(table.schema, prompt_key, answer_key, path)
    check_rows(table, prompt_key, answer_key, path, offset)


def _leaves(pf, key: str, message_list: bool) -> list[str]:
    """The parquet leaf columns a row check of `key` needs: for chat-message lists only the
    `role` leaf (it carries the lists' structure; the long `content` strings stay on disk)."""
    paths = [pf.schema.column(i).path for i in range(len(pf.schema))]
    under = [p for p in paths if p == key or p.startswith(key + ".")]
    if message_list:
        roles = [p for p in under if p.endswith(".role")]
        return roles[:1] or under
    return under


class IpcRows:
    """Rows of an Arrow IPC file, memory-mapped, one record batch at a time: no table of every
    batch is built (tens of thousands of small batches would cost hundreds of MB of objects)."""

    def __init__(self, path: Path) -> None:
        import numpy as np
        import pyarrow as pa
        self.reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        # The batch sizes were recorded beside the file when it was written: counting them here
        # would touch every batch's pages (230 MB resident for a million rows).
        counts = np.load(str(path) + ".rows.npy")
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self.schema = self.reader.schema

    def row(self, i: int) -> dict:
        import numpy as np
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.reader.get_batch(k).slice(i - int(self.starts[k]), 1).to_pylist()[0]

    def column_chunks(self, name: str):
        for k in range(self.reader.num_record_batches):
            yield self.reader.get_batch(k).column(name)


def parquet_files(path: Path) -> list[Path]:
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
        import numpy as np
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        schema = pq.ParquetFile(files[0]).schema_arrow
        counts = []
        try:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for f in files:
                    # Small record batches: reading one row of a memory-mapped batch touches pages in
                    # proportion to the batch (a list/struct column of chat messages measured 400 KB
                    # a row at 8192 rows a batch, 37 KB at 256); 64 rows keep a million-row set's
                    # peak RSS under 300 MB after a thousand random reads (benchmarks/data.py).
                    for batch in pq.ParquetFile(f, memory_map=True, pre_buffer=False).iter_batches(batch_size=64):
                        writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
                        counts.append(batch.num_rows)
            np.save(str(target) + ".rows.npy", np.asarray(counts, dtype=np.int64))
        except BaseException:
            tmp.unlink(missing_ok=True)  # nothing half-written stays behind
            raise
        os.replace(tmp, target)  # the data file last: it marks the cache complete
    return IpcRows(target)


def check_same_schema(files: list[Path], parquet: list) -> None:
    """The shards of one set have one schema (they become one table): else one line naming the
    two files and the first column that differs, before anything is converted."""
    first = parquet[0].schema_arrow
    for f, pf in zip(files[1:], parquet[1:]):
        other = pf.schema_arrow
        if other.equals(first):
            continue
        a, b = {fl.name: fl.type for fl in first}, {fl.name: fl.type for fl in other}
        name = next((n for n in list(a) + list(b) if a.get(n) != b.get(n)), None)
        what = (f"{name!r} is {a[name]} in one and {b[name]} in the other" if name in a and name in b
                else f"{name!r} is only in {files[0].name if name in a else f.name}" if name
                else "the columns are in another order")
        raise PromptFileError(f"{files[0]} and {f}: the shards of one prompt set must have one schema; "
                              f"{what}")


def open_parquet(path: Path, files: list[Path], cache_dir) -> ArrowSource:
    parquet = _read_parquet_schema_checked(files)
    check_same_schema(files, parquet)
    return ArrowSource(path, files, lambda: _arrow_cache(files, cache_dir), "parquet", parquet)


def saved_dataset(path: Path) -> ArrowSource:
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
