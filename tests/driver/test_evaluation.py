"""Held-out evaluation during training (gspo_megatron/driver/evaluation.py): before step 0, before every
eval.interval-th step and after the last one, on the live SGLang server; its metrics equal a count
by hand over the eval responses, per data_source too, and a PP2 run gives the same ones.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_prompt_sets import verl_parquet
from test_trainer_e2e import base_overrides, run_train, server_url  # noqa: F401

pytestmark = pytest.mark.slow
CONFIG = "examples/tiny_moe_larger_digit.yaml"


def _args(run_dir: Path, url: str, **extra) -> list[str]:
    held_out = verl_parquet(run_dir / "data" / "eval.parquet", 6, start=100)
    return [CONFIG, *base_overrides(run_dir, url, **{
        "train.steps": 3, "train.warm_start_steps": 0, "eval.prompts": held_out, "eval.interval": 2,
        "eval.answer_key": "reward_model.ground_truth", "eval.samples_per_prompt": 2, "eval.temperature": 0.6,
        "eval.reward": "prompt_rewards:by_source", "eval.max_new_tokens": 6,
        "logging.eval_records": str(run_dir / "eval.jsonl"), **extra})]


def _by_hand(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    out = {}
    for step in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == step]
        prompts = sorted({r["prompt_index"] for r in mine})
        m = {"eval/accuracy": sum(r["reward"] >= 1 for r in mine) / len(mine),
             "eval/pass@k": sum(any(r["reward"] >= 1 for r in mine if r["prompt_index"] == p) for p in prompts)
             / len(prompts),
             "eval/response_length": sum(len(r["response_ids"]) for r in mine) / len(mine)}
        for source in sorted({r["data_source"] for r in mine}):
            src = [r for r in mine if r["data_source"] == source]
            m[f"eval/accuracy/{source}"] = sum(r["reward"] >= 1 for r in src) / len(src)
        out[step] = m
    return out


def _logged(run_dir: Path) -> dict[float, dict[str, float]]:
    from gspo_megatron.run.metrics import read_jsonl
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in read_jsonl(run_dir / "tb" / "metrics.jsonl") if "eval/accuracy" in r}


def test_eval_at_step_0_the_interval_and_the_end_equals_a_hand_count(tmp_path, server_url):  # noqa: F811
    from gspo_megatron.run.metrics import read_scalars
    proc = run_train(_args(tmp_path, server_url))
    assert proc.returncode == 0, proc.stderr[-5000:]
    logged, hand = _logged(tmp_path), _by_hand(tmp_path)
    assert sorted(logged) == sorted(hand) == [0, 2, 3]  # before steps 0 and 2, after the last (3)
    for step, m in hand.items():
        for k, v in m.items():
            assert logged[step][k] == pytest.approx(v), (step, k)
        # by_source rewards 1.0 on alpha rows, 0.5 on beta: per-source accuracy 1 and 0
        assert logged[step]["eval/accuracy/alpha"] == 1.0 and logged[step]["eval/accuracy/beta"] == 0.0
        assert logged[step]["eval/pass@k/alpha"] == 1.0
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, 2, 3] and len(scalars["time/eval"]) == 3
    rows = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 6 * 2  # 3 evals x 6 prompts x 2 samples


def test_eval_under_pp2_equals_one_process(tmp_path, server_url):  # noqa: F811
    """PP2: the eval runs where the rollouts do (rank 0), while the loss is on the last stage (rank
    1). Under TP2 every rank is in the last stage, as in one process (test_async_rl runs both)."""
    # greedy, one sample per prompt: eval requests carry no seed, so only greedy responses repeat
    same = {"train.lr": 0.0, "eval.samples_per_prompt": 1, "eval.temperature": 0.0}
    one = run_train(_args(tmp_path / "one", server_url, **same))
    assert one.returncode == 0, one.stderr[-5000:]
    two = run_train(_args(tmp_path / "two", server_url, **same) + ["--set", "parallel.pipeline=2"],
                    nproc=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    assert _logged(tmp_path / "one") == _logged(tmp_path / "two")
    assert _by_hand(tmp_path / "two") == _by_hand(tmp_path / "one")
