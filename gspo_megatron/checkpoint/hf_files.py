"""Hugging Face checkpoint directories: read tensors one at a time, write size-bounded shards.

    reader = HFTensorReader(hf_dir)            # model.safetensors or *.safetensors.index.json
    t = reader.get("model.embed_tokens.weight")
    with HFShardWriter(out_dir, max_shard_bytes=5 << 30) as w:
        w.add("model.embed_tokens.weight", t)  # flushed to a shard when the shard is full
    check_weight_files(hf_dir)                 # DamagedFileError naming a truncated / broken file
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gspo_errors import InputError, MissingInputError
from model_specs.weights.maps import WeightMapError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# What travels with the weights: config, generation defaults, tokenizer and chat template.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                  "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F64": torch.float64}


class DamagedFileError(InputError, ValueError):
    """A file that exists but cannot be used (truncated, not the format it claims); the message
    names the file and what is wrong with it."""


@dataclasses.dataclass
class SafetensorsHeader:
    raw: bytes                     # the header's JSON bytes as stored
    tensors: dict[str, Any]        # name -> {"dtype", "shape", "data_offsets"}
    data_bytes: int                # where the last tensor ends (bytes after the header)


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """The header of a .safetensors file, checked against the file's size: DamagedFileError names
    the file if the header is unreadable or the file is shorter or longer than the header says.
    (safetensors' own error for a truncated file, "incomplete metadata", names no file.)"""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DamagedFileError(f"{path} is damaged: {size} bytes, too short for a safetensors "
                                   f"header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise DamagedFileError(f"{path} is truncated: its header needs {n} bytes, the file has "
                                   f"{size - 8} after the length prefix")
        raw = f.read(n)
    try:
        tensors = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        data_bytes = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise DamagedFileError(f"{path} is damaged: unreadable safetensors header "
                               f"({type(e).__name__}: {e})") from None
    if size != 8 + n + data_bytes:
        state = "truncated" if size < 8 + n + data_bytes else "damaged"
        raise DamagedFileError(f"{path} is {state}: {size} bytes, its header describes "
                               f"{8 + n + data_bytes}")
    return SafetensorsHeader(raw, tensors, data_bytes)


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory (the index's, or model.safetensors)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DamagedFileError(f"{index} is damaged: not a safetensors index "
                                   f"({type(e).__name__}: {e})") from None
        missing = [n for n in names if not (hf_dir / n).is_file()]
        if missing:
            raise MissingInputError(f"{index} lists {missing[0]}, which is not in {hf_dir}")
        return [hf_dir / n for n in names]
    if (hf_dir / SINGLE_NAME).is_file():
        return [hf_dir / SINGLE_NAME]
    raise MissingInputError(f"no {SINGLE_NAME} or {INDEX_NAME} in {hf_dir}")


def check_weight_files(hf_dir: str | Path) -> None:
    """Every weight file of an HF model is present and as long as its header says."""
    for path in weight_files(hf_dir):
        read_safetensors_header(path)


class TensorReader(Protocol):
    """What the converter reads an HF checkpoint through: HFTensorReader, or a reader that
    rewrites another's tensors (mxfp4.StackedExpertsReader)."""

    dir: Path

    @property
    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def get_shape_checked(self, name: str, expected_shape: Sequence[int]) -> None: ...
    def get(self, name: str) -> torch.Tensor: ...


class HFTensorReader:
    """Name -> tensor access to an HF safetensors checkpoint, one tensor in memory at a time."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.file_of: dict[str, str] = {}
        self._stored: dict[str, str] = {}
        for path in weight_files(self.dir):
            tensors = read_safetensors_header(path).tensors
            self.file_of.update({k: path.name for k in tensors})
            self._stored.update({k: str(v.get("dtype")) for k, v in tensors.items()})
        self._open: dict[str, object] = {}

    def stored_dtype(self, name: str) -> str:
        """The tensor's safetensors dtype as its file's header says: F32, BF16, I32, U8, ..."""
        return self._stored[name]

    @property
    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._handle(name).get_slice(name).get_dtype()]

    def get_shape_checked(self, name: str, expected_shape: Sequence[int]) -> None:
        """Raise WeightMapError if the tensor is missing or its shape is not `expected_shape`."""
        if self.shape(name) != tuple(expected_shape):
            raise WeightMapError(f"HF tensor {name} in {self.dir} has shape {self.shape(name)}, "
                                 f"the config implies {tuple(expected_shape)}")

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str):
        if name not in self.file_of:
            raise WeightMapError(f"missing tensor {name} in HF checkpoint {self.dir}")
        fname = self.file_of[name]
        if fname not in self._open:
            self._open[fname] = safe_open(str(self.dir / fname), "pt")
        return self._open[fname]


class HFShardWriter:
    """Writes tensors into model-0000i-of-0000N.safetensors shards + the index, streaming."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self._shards)
        save_file(self._pending, str(self.dir / f"tmp-shard-{idx:05d}.safetensors"),
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                              for i in range(n)]
        weight_map = {}
        for i, (fname, keys) in enumerate(zip(names, self._shards)):
            (self.dir / f"tmp-shard-{i:05d}.safetensors").rename(self.dir / fname)
            weight_map.update({k: fname for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def __enter__(self) -> "HFShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


def copy_metadata_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, generation config and tokenizer files (those present) from src to dst."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in METADATA_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if "config.json" not in copied:
        raise MissingInputError(f"no config.json in {src}")
    return copied
