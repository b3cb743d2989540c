"""Tiny HF models for tests, built once per test process and cached (tools/make_tiny_model.py).

    from fixtures_models import tiny_model_dir
    path = tiny_model_dir("qwen3_moe", seed=0)        # a directory with config, weights, tokenizer

Each (arch, seed, tie) is written once under a per-process temporary directory that is removed at
exit; callers must not modify it (copy it first if a test needs to change weights).
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from tools.make_tiny_model import make_tiny_model

_ROOT: Path | None = None
_CACHE: dict[tuple[str, int, bool], Path] = {}


def tiny_model_dir(arch: str, seed: int = 0, tie: bool = False) -> Path:
    """Path of a tiny random `arch` model made with `seed` (tied embeddings when `tie`)."""
    global _ROOT
    key = (arch, seed, tie)
    if key not in _CACHE:
        if _ROOT is None:
            _ROOT = Path(tempfile.mkdtemp(prefix="gspo-tiny-models-"))
            atexit.register(shutil.rmtree, _ROOT, True)
        out = _ROOT / f"{arch}-seed{seed}{'-tied' if tie else ''}"
        _CACHE[key] = make_tiny_model(arch, out, seed=seed, tie_word_embeddings=tie)
    return _CACHE[key]
