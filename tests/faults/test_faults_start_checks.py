"""What the start checks refuse before anything is spent, on the surfaces added last: a config with a
section twice, optimizer offload on a CPU, a prompt longer than the model's context, a model SGLang
cannot serve on a CPU, a teacher with fewer rows than the student's ids or without a tokenizer.
Each is one line naming the field or file and what was expected, exit 2, before any folder is
written or server started (run/model_checks.py; the checks run in this process: no server is needed,
none is started).

Before: the config kept the second `model:` silently ("model.hf_path=''" then); offload was a
31-line traceback, exit 1; the long prompt failed at step 0 after the server start, exit 3; gpt-oss
was SGLang's 30-line assertion after the server start, exit 3; the teacher's server died on the first
request three times and the run exited 75, "retryable"; a teacher without tokenizer files had
"another vocabulary ... the teacher's 1".
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from faults_common import CONFIG, in_process_error
from fixtures_models import tiny_model_dir
from test_trainer_e2e import ROOT


def _args(tmp_path: Path, **sets: object) -> list[str]:
    base = {"model.hf_path": tiny_model_dir("qwen3_moe", 0), "checkpoint.dir": tmp_path / "ck",
            "logging.tensorboard_dir": tmp_path / "tb", "checkpoint.export_hf": "null", **sets}
    return [CONFIG, *(a for k, v in base.items() for a in ("--set", f"{k}={v}"))]


def _refused(capsys, tmp_path: Path, *args: str) -> str:
    """exit 2 and one line (faults_common.in_process_error), nothing written."""
    line = in_process_error(capsys, list(args))
    assert not (tmp_path / "ck").exists() and not (tmp_path / "tb").exists()
    return line


def test_a_config_with_a_section_twice_is_refused_naming_the_key_and_lines(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    text = (ROOT / CONFIG).read_text()
    config.write_text(text + "\nmodel:\n  dtype: bfloat16\n")
    first = 1 + text.splitlines().index("model:")
    again = len(text.splitlines()) + 2
    line = _refused(capsys, tmp_path, str(config))
    assert line == (f"gspo-megatron: error: config file '{config}': the key 'model' appears twice (lines {first} "
                    f"and {again}); YAML keeps only the second: merge the two into one")
    config.write_text(text.replace("  steps: 100\n", "  steps: 100\n  lr: 0.1\n  steps: 5\n"))
    assert "the key 'train.steps' appears twice (lines" in _refused(capsys, tmp_path, str(config))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU's")
def test_optimizer_offload_on_a_cpu_is_one_line(tmp_path, capsys):
    line = _refused(capsys, tmp_path, *_args(tmp_path, **{"train.use_distributed_optimizer": "true",
                                                         "train.optimizer_cpu_offload": "true"}))
    assert line.startswith("gspo-megatron: error: train.optimizer_cpu_offload=True needs CUDA GPUs"), line
    assert line.endswith("on a CPU the optimizer's state is on the host already: set it false")


def _model_with(tmp_path: Path, name: str, source: Path, **config: object) -> Path:
    out = tmp_path / name
    shutil.copytree(source, out)
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, **config}))
    return out


def test_a_prompt_longer_than_the_context_is_refused_with_max_prompt_tokens_as_the_way(tmp_path, capsys):
    """The tiny model served with a context of 64 tokens (max_position_embeddings), 8 new tokens:
    a 100-word prompt is named by its file and line; rollout.max_prompt_tokens above 56 is refused
    by the arithmetic alone; at 56 the long prompt is dropped at load and the check passes."""
    model = _model_with(tmp_path, "model", tiny_model_dir("qwen3_moe", 0), max_position_embeddings=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Which is larger: 3 or 7?", "answer": "7"},
        {"prompt": " ".join(["seven"] * 100), "answer": "7"},
    ]))
    sets = {"model.hf_path": model, "rollout.prompts": prompts, "rollout.max_new_tokens": 8}
    line = _refused(capsys, tmp_path, *_args(tmp_path, **sets))
    assert line.startswith(f"gspo-megatron: error: rollout.prompts: the prompt of {prompts}:2 is "), line
    assert line.endswith("tokens through the chat template; with rollout.max_new_tokens=8 that passes the model's "
                         "context of 64 tokens (max_position_embeddings 64 in its config.json), which SGLang "
                         "refuses: set rollout.max_prompt_tokens (<= 56) to drop such prompts when the set is "
                         "loaded"), line
    line = _refused(capsys, tmp_path, *_args(tmp_path, **sets, **{"rollout.max_prompt_tokens": 57}))
    assert line == ("gspo-megatron: error: rollout.max_prompt_tokens=57: with rollout.max_new_tokens=8 a prompt "
                    "it keeps may need 65 tokens, more than the model's context of 64 (max_position_embeddings "
                    "64 in its config.json), which SGLang refuses; expected <= 56")
    from gspo_megatron.config import load_config
    from gspo_megatron.run.model_checks import check_prompts_fit
    from gspo_megatron.run.preflight import check_prompts
    cfg = load_config(CONFIG, _args(tmp_path, **sets, **{"rollout.max_prompt_tokens": 56})[2::2])
    check_prompts_fit(cfg, *check_prompts(cfg), model)  # the filter keeps no prompt over 56 tokens
    line = _refused(capsys, tmp_path, *_args(tmp_path, **sets, **{
        "rollout.server_extra_args": "[--context-length, '8']"}))
    assert line.startswith("gspo-megatron: error: rollout.max_new_tokens=8: expected less than the model's "
                           "context of 8 tokens (--context-length in rollout.server_extra_args)"), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU's")
def test_gpt_oss_as_policy_or_teacher_on_a_cpu_is_refused_before_any_server(tmp_path, capsys):
    gpt_oss = tiny_model_dir("gpt_oss", 0)
    line = _refused(capsys, tmp_path, *_args(tmp_path, **{"model.hf_path": gpt_oss, "rollout.server_urls": "[]"}))
    assert line.startswith(f"gspo-megatron: error: model.hf_path='{gpt_oss}' is a gpt_oss model, which SGLang "
                           "cannot serve on a CPU: "), line
    assert line.endswith("run on CUDA GPUs, or give rollout.server_urls of servers that run on GPUs"), line
    line = _refused(capsys, tmp_path, *_args(tmp_path, **{
        "distill.teacher": gpt_oss, "loss.name": "gspo_token", "distill.reward_coef": 0,
        "rollout.server_urls": "[http://127.0.0.1:9]"}))
    assert line.startswith(f"gspo-megatron: error: distill.teacher='{gpt_oss}' is a gpt_oss model, which SGLang "
                           "cannot serve on a CPU"), line
    assert "distill.teacher_server_urls of servers that run on GPUs" in line


def _teacher_args(tmp_path: Path, teacher: Path) -> list[str]:
    return _args(tmp_path, **{"distill.teacher": teacher, "loss.name": "gspo_token", "distill.reward_coef": 0,
                              "rollout.server_urls": "[http://127.0.0.1:9]"})


def test_a_teacher_with_fewer_rows_than_the_students_ids_is_an_input_error_before_any_server(tmp_path, capsys):
    """The student's tokenizer and a teacher of 384 rows (its config and weights agree): the student
    samples ids up to 511, on which the teacher's server died on every request (exit 75 after three
    restarts). Refused at start, exit 2."""
    from tools.make_tiny_model import make_tiny_model
    teacher = make_tiny_model("qwen3", tmp_path / "teacher", seed=1, vocab_size=384)
    student = tiny_model_dir("qwen3_moe", 0)
    assert (teacher / "tokenizer.json").read_bytes() == (student / "tokenizer.json").read_bytes()
    line = _refused(capsys, tmp_path, *_teacher_args(tmp_path, teacher))
    assert line == (f"gspo-megatron: error: distill.teacher='{teacher}' has vocab_size 384, below the student's 512 "
                    f"(model.hf_path='{student}'): the student can sample token ids up to 511, which the teacher "
                    "cannot score; give a teacher with at least 512 rows (its vocab_size and embedding)")


def test_a_teacher_without_tokenizer_files_is_said_so(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir("qwen3", 0), teacher)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
        (teacher / name).unlink(missing_ok=True)
    line = _refused(capsys, tmp_path, *_teacher_args(tmp_path, teacher))
    assert line.startswith(f"gspo-megatron: error: distill.teacher='{teacher}': no tokenizer there (none of "
                           "tokenizer.json, "), line
    assert line.endswith("on-policy distillation needs the student's tokenizer in the teacher's folder")


def test_qwen3_next_on_hopper_with_a_broken_triton_is_refused_at_start(tmp_path, capsys, monkeypatch):
    """On an H200 with torch 2.11's Triton 3.6.0 flash-linear-attention refused the DeltaNet's
    backward at the first step, after the set-up (2026-12-04): the start checks refuse it, one line,
    exit 2. The machine is faked (Available.detect): no Hopper GPU runs here."""
    import dataclasses

    from gspo_megatron.actor.settings import Available
    hopper = Available(cuda=True, transformer_engine=False, apex_wgrad=False, gpu_name="NVIDIA H200",
                       gpu_capability=(9, 0), triton_version="3.6.0")
    monkeypatch.setattr(Available, "detect", staticmethod(lambda: hopper))
    qwen3_next = tiny_model_dir("qwen3_next", 0)
    sets = {"model.hf_path": qwen3_next, "rollout.server_urls": "[http://127.0.0.1:9]"}
    line = _refused(capsys, tmp_path, *_args(tmp_path, **sets))
    assert line.startswith("gspo-megatron: error: Gated DeltaNet layers (Qwen3-Next) on NVIDIA H200 (compute "
                           "capability 9.0) with Triton 3.6.0: "), line
    assert line.endswith("install triton>=3.7.1, or tilelang with an nvcc on PATH or CUDA_HOME (fla's "
                         "TileLang backend), then start again"), line
    # with fla's fixed Triton the checks go on: the next one refuses a layout for 2 ranks on 1
    monkeypatch.setattr(Available, "detect", staticmethod(lambda: dataclasses.replace(hopper, triton_version="3.7.1")))
    line = _refused(capsys, tmp_path, *_args(tmp_path, **sets, **{"parallel.tensor": 2}))
    assert "Gated DeltaNet" not in line and "world size 1" in line, line
