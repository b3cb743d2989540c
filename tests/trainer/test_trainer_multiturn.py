"""Multi-turn GSPO through the real trainer: `gspo-megatron train` with rollout.environment, TP2
under torchrun, a real SGLang server (the session's shared one). After the run every trained row
is rebuilt from the rollout records and checked: environment tokens have loss_mask 0 in the
actor's batch; model tokens have loss_mask 1 and the log-prob SGLang returned for them; model
tokens are exactly the server's output ids, and environment tokens exactly the chat template's
tokens of the observation text (nothing was re-encoded from decoded text); per-token advantages
follow the documented per-turn rule. Then the run resumes without losing or repeating a step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_trainer_e2e import base_overrides, run_train, server_url  # noqa: F401

pytestmark = pytest.mark.slow


def _args(run_dir: Path, url: str, **extra) -> list[str]:
    sets = {"rollout.environment": "calculator", "rollout.max_turns": 3,
            "rollout.prompts": "examples/data/calculator.jsonl", "rollout.group_size": 4,
            "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 128,
            "rollout.max_turn_tokens": 12, "train.steps": 2, "train.warm_start_steps": 0,
            "logging.rollout_records": str(run_dir / "records.jsonl"), **extra}
    return ["examples/tiny_moe_calculator.yaml", *base_overrides(run_dir, url, **sets)]


def _return_to_go_credit(turn_rewards: list[list[float]], group_size: int, discount: float) -> list[list[float]]:
    """The documented rule (docs/algorithm.md, grpo): G_{i,k} = sum_{m >= k} discount^(m - k) r_{i,m},
    A_{i,k} = (G_{i,k} - mean_j G_{j,1}) / (std_j G_{j,1} + 1e-6) over i's group, 0 where the
    group's returns are all equal."""
    returns = [[sum(discount ** (m - k) * r[m] for m in range(k, len(r))) for k in range(len(r))]
               for r in turn_rewards]
    out = []
    for start in range(0, len(returns), group_size):
        group = returns[start:start + group_size]
        firsts = [g[0] for g in group]
        mean = sum(firsts) / len(firsts)
        std = (sum((x - mean) ** 2 for x in firsts) / len(firsts)) ** 0.5
        out += [[0.0 if max(firsts) == min(firsts) else (x - mean) / (std + 1e-6) for x in g] for g in group]
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


def test_multiturn_tp2_rows_rebuilt_from_records_and_resume(tmp_path, server_url):  # noqa: F811
    import transformers

    from fixtures_models import tiny_model_dir
    from gspo_megatron.run.metrics import read_jsonl, read_scalars
    from rollout.generation.multiturn.chat import ChatTemplate

    args = _args(tmp_path, server_url, **{"parallel.tensor": 2, "loss.name": "gspo_token",
                                          "rollout.turn_credit": "return_to_go",
                                          "rollout.turn_discount": 0.9})
    proc = run_train(args, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    chat = ChatTemplate(transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0)))
    records = _records(tmp_path)
    assert sorted({r["step"] for r in records}) == [0, 1] and len(records) == 2 * 8
    env_tokens = 0
    for r in records:
        row, mask, lps = r["batch_tokens"], r["batch_loss_mask"], r["batch_rollout_log_probs"]
        assert row == r["prompt_ids"] + r["response_ids"]
        p, meta = len(r["prompt_ids"]), r["metadata"]
        assert mask[:p] == [0] * p
        outputs, observations = iter(meta["turn_outputs"]), iter(meta["observations"])
        for kind, a, b in meta["spans"]:
            if kind == "model":
                out = next(outputs)
                assert r["response_ids"][a:b] == out["output_ids"]  # the server's ids, as returned
                assert mask[p + a:p + b] == [1] * (b - a)
                assert all(abs(x - y) < 1e-6 for x, y in zip(lps[p + a:p + b], out["logprobs"]))
            else:
                obs = next(observations)
                assert mask[p + a:p + b] == [0] * (b - a)
                env_tokens += b - a
                # exactly the template's tokens of the observation text (never decoded model text)
                assert r["response_ids"][a:b] == chat.observation_ids(
                    obs["text"], role=obs["role"], model_turn_closed=obs["model_turn_closed"])
        assert meta["spans"][-1][2] == len(r["response_ids"])
    assert env_tokens > 0, "no episode got an environment turn: the check would be empty"
    # per-token advantages: the documented rule, group by group
    for step in (0, 1):
        rows = sorted((r for r in records if r["step"] == step), key=lambda r: r["row"])
        want = _return_to_go_credit([r["metadata"]["turn_rewards"] for r in rows], 4, 0.9)
        for r, w in zip(rows, want):
            p = len(r["prompt_ids"])
            models = [(a, b) for kind, a, b in r["metadata"]["spans"] if kind == "model"]
            for (a, b), value in zip(models, w):
                assert all(abs(x - value) < 1e-5 for x in r["batch_advantages"][p + a:p + b])
    scalars = read_scalars(tmp_path / "tb")
    for tag in ("rollout/turns_per_episode", "rollout/tool_calls_per_episode", "rollout/env_token_fraction",
                "rollout/reward_per_turn", "rollout/episode_length_mean", "rollout/truncated_fraction"):
        assert [s for s, _ in scalars[tag]] == [0, 1], tag
    assert all(v > 0 for _, v in scalars["rollout/env_token_fraction"])

    resumed = run_train(_args(tmp_path, server_url, **{"parallel.tensor": 2, "loss.name": "gspo_token",
                                                       "rollout.turn_credit": "return_to_go",
                                                       "rollout.turn_discount": 0.9, "train.steps": 3}),
                        nproc=2)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)] == [0, 1, 2]
    assert [s for s, _ in read_scalars(tmp_path / "tb")["rollout/reward_mean"]] == [0, 1, 2]
    assert sorted({r["step"] for r in _records(tmp_path)}) == [0, 1, 2]


def test_broken_environment_is_recorded_and_counted(tmp_path, server_url):  # noqa: F811
    """Errors of a user's environment end the episode with reward 0 and are counted under the
    reward error budget: tolerated up to rollout.max_reward_error_fraction, then one line."""
    args = _args(tmp_path, server_url, **{"rollout.environment": "tests.envs_for_tests:FlakyCalculator",
                                          "rollout.max_reward_error_fraction": 1.0, "train.steps": 1})
    proc = run_train(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [r["metadata"]["env_error"] for r in _records(tmp_path) if "env_error" in r["metadata"]]
    assert errors and all(r["reward"] == 0.0 for r in _records(tmp_path) if "env_error" in r["metadata"])
    assert any(e.startswith("ValueError: calculator crashed") for e in errors) or \
        any("reward 'not a number' is not a number" in e for e in errors), errors
    from gspo_megatron.run.metrics import read_jsonl
    assert read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)[0]["rollout/env_error_fraction"] > 0
    strict = run_train(_args(tmp_path / "strict", server_url, **{
        "rollout.environment": "tests.envs_for_tests:FlakyCalculator", "train.steps": 1}))
    lines = [ln for ln in strict.stderr.splitlines() if ln.startswith("gspo-megatron: error")]
    assert strict.returncode == 3 and len(lines) == 1, strict.stderr[-3000:]  # a runtime stop
    assert "the reward (or environment) failed" in lines[0] and "last error:" in lines[0]
