"""The checks the command line makes before torch and megatron-core are imported (a fraction of a
second instead of several seconds and a screen of import warnings): the model directory's
config.json, the parallel layout against the model's dimensions and the world size, the prompt
file, and (rank 0) that no live run holds the run's folders. startup.check_inputs makes them
again with the model family's own table, then everything that needs torch (weight files, compute
settings, the resume checkpoint); startup.setup then takes the locks.

    early_checks(cfg, world_size)   # raises ConfigError, LayoutError, HFConfigError,
                                    # PromptFileError, FileNotFoundError or RunLockedError
                                    # (another live run holds the run's folders), naming the value
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from gspo_megatron.config import RunConfig
from model_specs.hf_config import load_hf_config, model_dims
from rollout.dataset import PromptFileError, PromptSet, load_prompts
from rollout.prompt_rows import resolved


def check_model_dir(cfg: RunConfig) -> Path:
    """model.hf_path, which must hold a config.json."""
    hf_dir = Path(cfg.model.hf_path)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path={resolved(hf_dir)}: no config.json there (expected a "
                                f"Hugging Face model directory)")
    return hf_dir


def check_prompts(cfg: RunConfig) -> tuple[PromptSet, PromptSet | None]:
    """rollout.prompts and eval.prompts exist and every row has a usable prompt and answer
    (PromptFileError names the field, the file, the row and the key); nothing is written."""
    r, e = cfg.rollout, cfg.eval
    train = _open("rollout.prompts", r.prompts, r.prompt_key, r.answer_key)
    held_out = None
    if e.interval and e.prompts:
        held_out = _open("eval.prompts", e.prompts, e.prompt_key or r.prompt_key, e.answer_key or r.answer_key)
    return train, held_out


def _open(field: str, spec, prompt_key: str, answer_key: str) -> PromptSet:
    try:
        return load_prompts(spec, prompt_key=prompt_key, answer_key=answer_key)
    except PromptFileError as err:
        raise PromptFileError(f"{field}: {err}") from None


def early_checks(cfg: RunConfig, world: int) -> None:
    hf = load_hf_config(check_model_dir(cfg))
    # An MoE config names its expert count (hf_config normalises the families' aliases to
    # num_experts); the family table, which imports megatron-core, decides it in check_inputs.
    dims = model_dims(hf, str(hf.get("model_type")), moe=hf.get("num_experts") is not None)
    cfg.parallel.validate_model(**dims)
    if cfg.compute.transformer_engine is False or importlib.util.find_spec("transformer_engine") is None:
        # a sure "no" for context parallelism; with TE installed check_inputs asks CUDA too
        cfg.parallel.check_context_parallel(transformer_engine=False, cuda=False, half=False)
    cfg.parallel.validate(world, **dims)
    check_prompts(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # the rank that takes the locks; another rank could
        # see its own rank 0's lock, taken meanwhile
        from gspo_megatron.run_folders import check_run_folders_unlocked
        check_run_folders_unlocked(cfg)  # RunLockedError: another live run holds a folder
