"""The start checks that read the models, before any server starts: the teacher against the student
(its files, its tokenizer, its vocabulary, its rows against the ids the student can sample), the
prompts against the context the policy is served with, and the models SGLang cannot serve on this
machine. preflight.check_inputs calls them; each failure is one line naming the field (exit 2).

    check_teacher(cfg, student_dir)                   # distill.teacher
    check_served_here(cfg, student_dir, cuda=False)   # gpt-oss without CUDA: refused
    check_prompts_fit(cfg, prompt_set, student_dir)   # rank 0: prompt + max_new_tokens <= context
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo_errors import MissingInputError
from gspo_megatron.config import ConfigError, RunConfig
from model_specs.hf.config import load_hf_config
from rollout.prompts.rows import resolved

if TYPE_CHECKING:
    from rollout.prompts.sets import PromptSet

# At least one of these makes a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# Model types SGLang cannot serve on a CPU, with why (model.hf_path or distill.teacher, when the run
# starts the servers itself on a machine without CUDA).
NOT_SERVED_ON_CPU = {
    "gpt_oss": "SGLang 0.5 serves gpt-oss only with an attention backend that has sinks "
               "(sglang/srt/arg_groups/model_hook.py asserts it at start), and none of its CPU "
               "backends has them",
}

# Where SGLang reads a model's context length, in its order (sglang 0.5
# srt/utils/hf_transformers/common.py CONTEXT_LENGTH_KEYS, get_context_length).
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def check_model_folder(field: str, path: str | Path) -> Path:
    """A Hugging Face model folder named by `field`: a folder (not a file) with a config.json."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise MissingInputError(f"{field}={resolved(folder)} is a file, not a folder (expected a "
                                "Hugging Face model directory with config.json)")
    if not (folder / "config.json").is_file():
        raise MissingInputError(f"{field}={resolved(folder)}: no config.json there (expected a "
                                f"Hugging Face model directory)")
    return folder


def check_teacher(cfg: RunConfig, student: Path) -> None:
    """distill.teacher: a model folder SGLang can load (config.json and its weights' shapes agree:
    model_specs/hf/tensors.py), with a tokenizer, the student's vocabulary, and a row for every id
    the student can sample; the failures name the teacher."""
    from gspo_megatron.checkpoint.hf_files import DamagedFileError, read_safetensors_header, weight_files
    from model_specs.hf.config import HFConfigError
    from model_specs.hf.tensors import shape_mismatch
    from rollout.generation.teacher import vocabulary_mismatch
    field = "distill.teacher"
    if cfg.distill.teacher is None:
        raise ValueError("the teacher's checks need distill.teacher")
    teacher = check_model_folder(field, cfg.distill.teacher)
    try:
        hf = load_hf_config(teacher)
        shapes = {name: t["shape"] for path in weight_files(teacher)
                  for name, t in read_safetensors_header(path).tensors.items()
                  if t["dtype"].startswith(("F", "BF"))}  # packed (integer) quantized weights aside
    except (MissingInputError, HFConfigError, DamagedFileError) as e:  # damaged files, a missing shard
        raise type(e)(f"{field}={resolved(teacher)}: {e}") from None
    why = shape_mismatch(hf, shapes)
    if why:
        raise ConfigError(f"{field}={resolved(teacher)} cannot be loaded: {why}; SGLang would refuse "
                          "its weights (fix the teacher's config.json or give its matching weights)")
    # The student samples from all of its output layer's rows, whatever its tokenizer names: a
    # teacher with fewer rows fails on the first such id, the same way on every retry.
    rows, student_rows = hf.get("vocab_size"), load_hf_config(student).get("vocab_size")
    if rows is not None and student_rows is not None and int(rows) < int(student_rows):
        raise ConfigError(f"{field}={resolved(teacher)} has vocab_size {rows}, below the student's "
                          f"{student_rows} (model.hf_path={str(student)!r}): the student can sample token "
                          f"ids up to {int(student_rows) - 1}, which the teacher cannot score; give a teacher "
                          f"with at least {student_rows} rows (its vocab_size and embedding)")
    if not any((teacher / n).is_file() for n in TOKENIZER_FILES):
        raise MissingInputError(f"{field}={resolved(teacher)}: no tokenizer there (none of "
                                f"{', '.join(TOKENIZER_FILES)}); on-policy distillation needs the "
                                "student's tokenizer in the teacher's folder")
    why = vocabulary_mismatch(str(student), str(teacher))
    if why:
        raise ConfigError(f"{field}={resolved(teacher)} has {why} (model.hf_path={str(student)!r}); "
                          "on-policy distillation needs the student's tokenizer")


def check_served_here(cfg: RunConfig, student: Path, cuda: bool) -> None:
    """A model the run would serve itself (no server URLs given) that SGLang cannot serve on this
    machine: refused before any server starts, instead of SGLang's assertion after its start."""
    if cuda:
        return
    served = []
    if not cfg.rollout.server_urls:
        served.append(("model.hf_path", student, "rollout.server_urls"))
    if cfg.distill.teacher and not cfg.distill.teacher_server_urls:
        served.append(("distill.teacher", Path(cfg.distill.teacher), "distill.teacher_server_urls"))
    for field, folder, urls in served:
        model_type = str(load_hf_config(folder).get("model_type"))
        if model_type in NOT_SERVED_ON_CPU:
            raise ConfigError(f"{field}={resolved(folder)} is a {model_type} model, which SGLang cannot serve "
                              f"on a CPU: {NOT_SERVED_ON_CPU[model_type]}; run on CUDA GPUs, or give {urls} "
                              "of servers that run on GPUs")


def served_context(cfg: RunConfig, model_dir: Path) -> tuple[int, str]:
    """(the context length SGLang serves the model with, where it comes from): --context-length in
    rollout.server_extra_args, else the model's config.json as SGLang reads it (get_context_length:
    the first of CONTEXT_LENGTH_KEYS, times a rope_scaling factor without an original length)."""
    args = cfg.rollout.server_extra_args
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--context-length=") else (
            args[i + 1] if arg == "--context-length" and i + 1 < len(args) else None)
        if value is not None and value.isdigit():
            return int(value), "--context-length in rollout.server_extra_args"
    raw: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # transformers 5 writes the latter
    factor = 1.0
    if scaling and "original_max_position_embeddings" not in scaling and scaling.get("rope_type") != "llama3":
        factor = float(scaling.get("factor", 1))
    for key in CONTEXT_LENGTH_KEYS:
        if raw.get(key) is not None:
            scaled = f" x rope_scaling factor {factor:g}" if factor != 1 else ""
            return int(factor * raw[key]), f"{key} {raw[key]}{scaled} in its config.json"
    return 2048, "SGLang's default, its config.json names none"


def check_prompts_fit(cfg: RunConfig, train: "PromptSet", held_out: "PromptSet | None", model_dir: Path) -> None:
    """Rank 0: SGLang refuses a request whose prompt and max_new_tokens pass the served context;
    such a prompt is refused here, naming its row, with rollout.max_prompt_tokens as the way to
    drop it (which makes the bound a matter of the config: checked without reading the rows)."""
    context, source = served_context(cfg, model_dir)
    r, e = cfg.rollout, cfg.eval
    sets: list[tuple[str, PromptSet, int, int | None, int | None]] = [
        ("rollout.prompts", train, r.max_new_tokens, r.max_prompt_tokens, None)]
    if held_out is not None:
        sets.append(("eval.prompts", held_out, e.max_new_tokens or r.max_new_tokens, None, e.max_prompts))
    tokenizer = None
    for field, prompts, new_tokens, bound, first in sets:
        room = context - new_tokens
        new_field = "eval.max_new_tokens" if field == "eval.prompts" and e.max_new_tokens else "rollout.max_new_tokens"
        if room < 1:
            raise ConfigError(f"{new_field}={new_tokens}: expected less than the model's context of {context} "
                              f"tokens ({source}), which holds the prompt too")
        if bound is not None:
            if bound > room:
                raise ConfigError(f"rollout.max_prompt_tokens={bound}: with rollout.max_new_tokens={new_tokens} a "
                                  f"prompt it keeps may need {bound + new_tokens} tokens, more than the model's "
                                  f"context of {context} ({source}), which SGLang refuses; expected <= {room}")
            continue  # drop_overlong_prompts keeps none longer
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        row, tokens = _first_overlong(prompts, tokenizer, room, first)
        if row is not None:
            where = prompts.with_kept(None).locate(row)
            fix = ("set rollout.max_prompt_tokens" if field == "rollout.prompts" else "shorten or drop it (eval "
                   "prompts are not filtered by rollout.max_prompt_tokens), or set eval.max_new_tokens")
            raise ConfigError(f"{field}: the prompt of {where[0].where(where[1])} is {tokens} tokens through the "
                              f"chat template; with {new_field}={new_tokens} that passes the model's context of "
                              f"{context} tokens ({source}), which SGLang refuses: {fix}"
                              + (f" (<= {room}) to drop such prompts when the set is loaded" if field == "rollout.prompts" else ""))


def _first_overlong(prompts: "PromptSet", tokenizer: Any, room: int, first: int | None) -> tuple[int | None, int]:
    """(global row, tokens) of the first prompt longer than `room` tokens through the chat template,
    or (None, 0). Only prompts that could be are tokenized: every token of a byte-level BPE or a
    byte-fallback SentencePiece covers at least one byte of the text, so a prompt's tokens are at
    most its text's UTF-8 bytes plus the template's own (measured on an empty message, and a
    margin per message); at the paper's prompt lengths no row is tokenized."""
    from rollout.prompts.dataset import chat_prompt_ids
    try:
        template = len(chat_prompt_ids(tokenizer, {"prompt": ""}))
    except ValueError as e:  # transformers: "Cannot use chat template functions because ... not set"
        raise ConfigError(f"model.hf_path: its tokenizer cannot apply a chat template ({e}); every prompt "
                          "goes through one (rollout/prompts/dataset.py chat_prompt_ids)") from None
    for row, prompt in prompts.prompts():
        if first is not None and row >= first:
            break
        if isinstance(prompt, str):
            bound = len(prompt.encode()) + template + 1
        elif isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
            bound = sum(len(m["content"].encode()) for m in prompt) + len(prompt) * (template + 8)
        else:
            bound = room + 1  # content parts, tool calls: tokenize
        if bound <= room:
            continue
        tokens = len(chat_prompt_ids(tokenizer, {"prompt": prompt}))
        if tokens > room:
            return row, tokens
    return None, 0
