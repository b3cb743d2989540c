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


_HF_MODELS: dict[str, object] = {}


def hf_response_logprobs(model_dir: Path | str, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response token | prefix) from a transformers forward in fp32 (temperature 1)."""
    import torch
    import transformers

    key = str(model_dir)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    model = _HF_MODELS[key]
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])            # [1, s]
    with torch.no_grad():
        logits = model(ids).logits.float()                                 # [1, s, v]
    logp = torch.log_softmax(logits[0, len(prompt_ids) - 1:-1], dim=-1)    # [r, v]
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def transformers_log_probs(hf_dir: Path, tokens, lengths, edit_model=None, **config_changes):
    """`[rows, seq]` log p(tokens[i, t] | tokens[i, < t]) from transformers in fp32 (each row on its
    own, its first `lengths[i]` tokens), NaN where undefined; `config_changes` set on the HF config
    before the model is built, `edit_model(model)` called after."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    for k, v in config_changes.items():
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, config=config,
                                                              dtype=torch.float32).eval()
    if edit_model is not None:
        edit_model(model)
    out = torch.full(tuple(tokens.shape), float("nan"))
    with torch.no_grad():
        for i, n in enumerate(lengths.tolist()):
            ids = tokens[i:i + 1, :n]                                         # [1, n]
            logp = torch.log_softmax(model(ids).logits.float()[0], dim=-1)     # [n, v]
            out[i, 1:n] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out
