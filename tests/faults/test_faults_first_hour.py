"""What a new user meets in the first hour: each refusal or message is one line, within
2 s of the command, with nothing written (no run folder, no cache, no .tmp file)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from faults_common import CONFIG
from fixtures_models import tiny_model_dir
from test_trainer_e2e import ROOT, env


def _train(tmp_path: Path, *sets: str) -> tuple[str, float]:
    """`gspo-megatron train CONFIG --set ...` as a user runs it: exit 2 and one error line, returned
    with the command's wall time; the run's folders (under tmp_path/run) must not exist after."""
    run = tmp_path / "run"
    args = [CONFIG, "--set", f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}", "--set", f"checkpoint.dir={run / 'ck'}",
            "--set", f"logging.tensorboard_dir={run / 'tb'}", "--set", "checkpoint.export_hf=null"]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo-megatron: error: "), proc.stderr[-3000:]
    assert not run.exists()
    return lines[0], seconds


def test_a_group_of_one_is_refused(tmp_path):
    line, seconds = _train(tmp_path, "rollout.group_size=1")
    assert ("rollout.group_size=1: expected >= 2: loss.advantage_estimator=grpo is relative to the prompt's group" in line
            and "would learn nothing" in line)
    assert seconds < 2, seconds


def test_n_greedy_eval_samples_are_refused(tmp_path):
    line, seconds = _train(tmp_path, "eval.samples_per_prompt=4", "eval.temperature=0")
    assert "eval.samples_per_prompt=4: expected 1 with eval.temperature=0: greedy decoding gives n identical" in line
    assert seconds < 2, seconds


def test_parquet_shards_with_different_schemas_are_named_before_anything(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    shards = tmp_path / "set"
    shards.mkdir()
    rows = lambda ids: {"prompt": [f"q{i}" for i in ids], "answer": [str(i) for i in ids]}  # noqa: E731
    pq.write_table(pa.table(rows(range(4))), shards / "train-00000-of-00002.parquet")
    other = rows(range(4, 8))
    other["answer"] = list(range(4, 8))  # int64 where the first shard has strings
    pq.write_table(pa.table(other), shards / "train-00001-of-00002.parquet")
    line, seconds = _train(tmp_path, f"rollout.prompts={shards}")
    assert line == (f"gspo-megatron: error: rollout.prompts: {shards / 'train-00000-of-00002.parquet'} and "
                    f"{shards / 'train-00001-of-00002.parquet'}: the shards of one prompt set must have one "
                    "schema; 'answer' is string in one and int64 in the other")
    assert seconds < 2, seconds
    assert sorted(p.name for p in shards.iterdir()) == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]


def test_a_dataset_dict_names_its_splits(tmp_path):
    import datasets
    folder = tmp_path / "dd"
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(folder))
    line, seconds = _train(tmp_path, f"rollout.prompts={folder}")
    assert (f"rollout.prompts: {folder}: a DatasetDict saved by save_to_disk, with the splits ['train', 'test']: "
            f"give one split's folder, e.g. {folder / 'train'}") in line
    assert seconds < 2, seconds


def test_relative_paths_show_where_they_point(tmp_path):
    line, seconds = _train(tmp_path, "model.hf_path=models/tiny")
    assert line == (f"gspo-megatron: error: model.hf_path='models/tiny' (= {ROOT / 'models' / 'tiny'}, relative "
                    "to the working directory): no config.json there (expected a Hugging Face model directory)")
    line, _ = _train(tmp_path, "rollout.prompts=data/nope.jsonl")
    assert f"'data/nope.jsonl' (= {ROOT / 'data' / 'nope.jsonl'}, relative to the working directory)" in line
    assert seconds < 2, seconds
    distill = ("loss.name=gspo_token", "distill.reward_coef=0")
    line, seconds = _train(tmp_path, *distill, "distill.teacher=teachers/tiny")
    assert line == (f"gspo-megatron: error: distill.teacher='teachers/tiny' (= {ROOT / 'teachers' / 'tiny'}, "
                    "relative to the working directory): no config.json there (expected a Hugging Face model "
                    "directory)")
    assert seconds < 2, seconds


def test_a_file_where_a_folder_is_expected_says_so(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    weights = tmp_path / "model.safetensors"
    line, seconds = _train(tmp_path, f"model.hf_path={weights}")
    assert line == (f"gspo-megatron: error: model.hf_path='{weights}' is a file, not a folder (expected a "
                    "Hugging Face model directory with config.json)")
    line, _ = _train(tmp_path, "loss.name=gspo_token", "distill.reward_coef=0", f"distill.teacher={weights}")
    assert line.startswith(f"gspo-megatron: error: distill.teacher='{weights}' is a file, not a folder")
    assert seconds < 2, seconds


def test_plan_where_nothing_fits_says_why_and_fails(tmp_path):
    """Every layout is computed first; the planner imports no torch (model_specs.shape), so the
    answer comes in about 0.3 s for Qwen3-235B-A22B."""
    for extra in (["--gpus", "3"], ["--gpus", "8", "--gpu-memory", "1GiB"]):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "plan", "examples/qwen3_235b_a22b.yaml",
                               "--model", "Qwen3-235B-A22B", *extra], cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=300)
        seconds = time.monotonic() - t0
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert seconds < 2, seconds
        assert "0 fit" in proc.stdout and "cannot hold the weights, gradients and optimizer state" in proc.stdout
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gspo-megatron plan: no layout fits ") and "the nearest" in last
    assert not any(tmp_path.iterdir())
