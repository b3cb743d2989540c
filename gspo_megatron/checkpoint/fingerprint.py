"""What derived state was made from: a fingerprint of a Hugging Face model directory.

    fp = model_fingerprint("/models/Qwen3-30B-A3B")   # config.json hash + each weight file's header
    change = describe_change(stored, fp)               # "" when equal, else what changed

Whatever the trainer derives from the model and keeps on disk (the initial megatron conversion,
the KL reference, a training checkpoint) records the fingerprint of the model it came from; a run
that finds a different one re-derives the state or stops with one line naming what changed.

Per weight file the fingerprint holds its size and a sha256 over its safetensors header (every
tensor's name, dtype, shape and offsets) and SAMPLES evenly spaced 4 KiB pieces of its data. Two
models of the same architecture (a base model and its fine-tune) have identical headers, so the
header alone would not tell them apart; the samples do, at the cost of reading 256 KiB per file
(milliseconds, even for a 235B model). A change confined to bytes between the samples (one edited
tensor element) is not detected.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gspo_megatron.checkpoint.hf_files import weight_files, read_safetensors_header

FINGERPRINT_FILE = "source.json"
SAMPLES, SAMPLE_BYTES = 64, 4096


def model_fingerprint(hf_dir: str | Path) -> dict[str, Any]:
    """{"config.json": sha256, "weights": {file name: [size in bytes, header sha256]}}.

    Raises DamagedFileError naming a weight file whose header is unreadable or whose size does
    not match its header (a truncated download or copy)."""
    hf_dir = Path(hf_dir)
    config = (hf_dir / "config.json").read_bytes()
    weights = {}
    for path in weight_files(hf_dir):
        header = read_safetensors_header(path)
        digest = hashlib.sha256(header.raw)
        size = path.stat().st_size
        start = 8 + len(header.raw)
        with open(path, "rb") as f:
            for k in range(SAMPLES):
                f.seek(start + (size - start) * k // SAMPLES)
                digest.update(f.read(SAMPLE_BYTES))
        weights[path.name] = [size, digest.hexdigest()]
    return {"config.json": hashlib.sha256(config).hexdigest(), "weights": weights}


def describe_change(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """'' if the fingerprints are equal, else a short description of the first differences."""
    if old == new:
        return ""
    if not isinstance(old, dict) or "weights" not in old:
        return "no record of its source model"
    changes = []
    if old.get("config.json") != new.get("config.json"):
        changes.append("config.json differs")
    before, after = old.get("weights", {}), new.get("weights", {})
    for name in sorted(set(before) | set(after)):
        if name not in after:
            changes.append(f"{name} is gone")
        elif name not in before:
            changes.append(f"{name} is new")
        elif before[name] != after[name]:
            changes.append(f"{name} differs (size {before[name][0]} -> {after[name][0]} bytes)"
                           if before[name][0] != after[name][0] else f"{name} differs (contents)")
    return ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")


def write_fingerprint(directory: str | Path, fingerprint: dict[str, Any], source: str) -> None:
    """Record in `directory` what it was made from (written before the directory is published)."""
    Path(directory, FINGERPRINT_FILE).write_text(
        json.dumps({"source": str(source), "fingerprint": fingerprint}, indent=1) + "\n")


def read_fingerprint(directory: str | Path) -> tuple[str | None, dict[str, Any] | None]:
    """(source path, fingerprint) recorded in `directory`, or (None, None) if there is none."""
    path = Path(directory, FINGERPRINT_FILE)
    try:
        data = json.loads(path.read_text())
        return data["source"], data["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
