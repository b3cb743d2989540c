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
from typing import Any

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


_HF_MODELS: dict[str, Any] = {}  # transformers models by path


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


def assert_same_hf_weights(a: Path, b: Path, context: object = "") -> None:
    """The HF model folders `a` and `b` hold the same tensors (model.safetensors), bit for bit and
    dtype for dtype; `context` goes into the message (a round trip's drawn sizes, the model)."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    assert sorted(x) == sorted(y), context
    for k, t in x.items():
        assert y[k].dtype == t.dtype and torch.equal(y[k], t), (context, k)


WARM_PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "data" / "larger_digit.jsonl"


def warm_tiny_moe_dir() -> Path:
    """The seed-0 tiny MoE after the main job's supervised warm start (40 cross-entropy steps of 32
    answers, Adam at 2e-3, on examples/data/larger_digit.jsonl's solutions), done once per test
    process with transformers in a few seconds. The trainer tests start from it with
    `train.warm_start_steps=0`: the same kind of policy (rewards ~0.1 at step 0, so groups have
    non-zero advantages and steps move the weights) without paying the warm start in every run
    (8 s per one-process run, 26 s under TP2 on 2 cores). The trainer's own warm start is tested
    where it is the subject (test_resume_run)."""
    key = ("qwen3_moe-warm", 0, False)
    if key in _CACHE:
        return _CACHE[key]
    import json

    import torch
    import transformers

    from gspo_megatron.driver.warm_start import sft_batch
    from rollout.prompts.dataset import chat_prompt_ids

    src = tiny_model_dir("qwen3_moe", 0)
    out = src.parent / "qwen3_moe-seed0-warm"
    tok = transformers.AutoTokenizer.from_pretrained(src)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    records = [json.loads(line) for line in WARM_PROMPTS.read_text().splitlines() if line.strip()]
    # the examples of gspo_megatron/driver/warm_start.py's warm_start_examples: the solution, else the answer, + EOS
    rows = [(chat_prompt_ids(tok, rec), tok.encode(str(rec.get("solution", rec["answer"])),
                                                   add_special_tokens=False) + [eos]) for rec in records]
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(1234)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        n = 32
        for k in range(40):
            batch = sft_batch([rows[(k * n + i) % len(rows)] for i in range(n)])  # the trainer's rows
            mask = torch.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
            labels = batch.tokens.masked_fill(~batch.loss_mask, -100)  # transformers shifts them
            loss = model(input_ids=batch.tokens, attention_mask=mask.long(), labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    shutil.copytree(src, out, dirs_exist_ok=True)  # tokenizer, configs
    model.save_pretrained(str(out), safe_serialization=True)
    _CACHE[key] = out
    return out
