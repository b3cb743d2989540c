"""The YAML `gspo-megatron migrate` prints trains: the issue's ROLL block, verl's GSPO recipe and
slime's GSPO flags, each migrated, then 3 steps of the tiny MoE with a real SGLang server (the
main job's machinery, tests/trainer/test_trainer_e2e.py; its sizes and files by --set, the
algorithm as migrated). And verl's REINFORCE++ and ROLL's reinforce with the KL in the reward under
DP2: the per-token advantages finished on both ranks' last stage (actor/reward_kl.py)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer_e2e import ROOT, base_overrides, run_train, server_url  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
PEERS = Path(__file__).parent / "peer_configs"
CASES = {"roll": ("roll", "roll_gspo.yaml"), "verl": ("verl", "verl_gspo.yaml"), "slime": ("slime", "slime_gspo.sh")}
# the tiny task's files and layout; everything else as migrated
LOCAL = {"parallel.tensor": 1, "parallel.expert": 1, "rollout.answer_key": "answer", "rollout.max_prompt_tokens": "null"}


def migrated(tmp_path: Path, peer: str, source: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "migrate", "--from", peer, str(source)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / f"{peer}.yaml"
    out.write_text(proc.stdout)
    return out


def _steps(run_dir: Path) -> list[dict]:
    from gspo_megatron.run.metrics import read_jsonl
    return read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_migrated_config_trains_three_steps(tmp_path, server_url, case):  # noqa: F811
    peer, name = CASES[case]
    config = migrated(tmp_path, peer, PEERS / name)
    proc = run_train([str(config)] + base_overrides(tmp_path / "run", server_url, **LOCAL))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in steps)
    start = next(line for line in proc.stdout.splitlines() if "advantage=" in line)
    assert case != "roll" or "loss=gspo seq-mean-token-sum eps_low=0.0003" in start, start  # as ROLL runs it
    assert {"roll": "advantage=reinforce reward_clip=10 whitened advantage_clip=2",
            "verl": "advantage=grpo group_std=unbiased", "slime": "advantage=grpo group_std=unbiased"}[case] in start


PER_TOKEN = {  # peer: (its file, the loss migrate gives it)
    "verl": ("verl.txt", "algorithm.adv_estimator=reinforce_plus_plus\nalgorithm.use_kl_in_reward=True\n"
             "algorithm.kl_penalty=low_var_kl\nalgorithm.kl_ctrl.kl_coef=0.05\n"
             "actor_rollout_ref.actor.policy_loss.loss_mode=gspo\n", "name: gspo_token"),
    # ROLL's seq with per-token advantages and token sums: gspo with ROLL's gradient through s_i
    "roll": ("roll.yaml", "adv_estimator: reinforce\nadd_token_level_kl: true\ninit_kl_coef: 0.05\n"
             "importance_sampling: seq\nloss_agg_mode: seq-mean-token-sum\nwhiten_advantages: true\n",
             "loss_agg_mode: seq-mean-token-sum"),
}


@pytest.mark.parametrize("peer", sorted(PER_TOKEN))
def test_per_token_advantages_with_the_kl_in_the_reward_train_under_dp2(tmp_path, server_url, peer):  # noqa: F811
    """verl's REINFORCE++ and ROLL's reinforce with the KL in the reward: per-token advantages
    finished on both ranks' last stage, into gspo_token (verl's GSPO) or gspo (ROLL's seq)."""
    name, text, expected = PER_TOKEN[peer]
    source = tmp_path / name
    source.write_text(text)
    config = migrated(tmp_path, peer, source)
    assert expected in config.read_text() and "name: gspo" in config.read_text()
    proc = run_train([str(config)] + base_overrides(tmp_path / "run", server_url, **LOCAL), nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in steps)
    assert steps[0]["time/ref_log_probs"] > 0  # the reference pass ran for the reward's KL
