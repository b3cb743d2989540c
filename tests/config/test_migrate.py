"""`gspo-megatron migrate --from roll|verl|slime FILE`: the issue's ROLL GSPO block (with a key ROLL
does not have), verl's GSPO recipe (nested YAML and Hydra overrides) and slime's GSPO flags: exit 0,
our YAML on stdout that passes the trainer's checks, and every input key named on stderr, carried or
not and why. The printed configs train: test_migrate_trains.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo_megatron.config import config_from_dict, load_config
from gspo_megatron.config.peers import migrate
from gspo_megatron.config.peers.slime import _flags
from gspo_megatron.config.peers.verl import override_keys

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).parent / "peer_configs"
REQUIRED = ["--set", "model.hf_path=/models/m", "--set", "rollout.prompts=/data/p.jsonl"]
CASES = {"roll": "roll_gspo.yaml", "verl": "verl_gspo_overrides.txt", "slime": "slime_gspo.sh"}


def run_migrate(peer: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "migrate", "--from", peer,
                           str(PEERS / name), *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)


def input_keys(peer: str, path: Path) -> list[str]:
    """The input's keys, read here independently of the migration's readers."""
    text = path.read_text()
    if peer == "slime":
        return [w[2:] for w in re.findall(r"(?m)^\s*(--[\w-]+)", text)]
    if peer == "verl" and path.suffix == ".txt":
        return [m.group(1) for m in re.finditer(r"(?m)^\+{0,2}([\w.]+)=", text)]

    def walk(d, prefix=""):
        for k, v in d.items():
            yield from walk(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return list(walk(yaml.safe_load(text)))


@pytest.mark.parametrize("peer", sorted(CASES))
def test_exit_0_every_key_named_and_the_output_passes_the_checks(peer):
    proc = run_migrate(peer, CASES[peer], *REQUIRED)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("[migrate] ") for line in lines), proc.stderr
    for key in input_keys(peer, PEERS / CASES[peer]):
        said = [line for line in lines if re.match(rf"\[migrate\] (carried|not carried|unknown)\s+{re.escape(key)}"
                                                    r"( =|,)", line)]
        assert said, f"{key} is not named on stderr"
        assert all(("->" in line) if "] carried" in line else (": " in line) for line in said), said
    cfg = config_from_dict(yaml.safe_load(proc.stdout))  # the trainer's own checks
    assert cfg.model.hf_path == "/models/m"


def test_the_roll_block():
    m = migrate("roll", PEERS / "roll_gspo.yaml")
    loss = m.nested()["loss"]
    assert loss == {"advantage_estimator": "reinforce", "name": "gspo", "loss_agg_mode": "seq-mean-token-sum",
                    "dual_clip_c": 1.4, "advantage_clip": 2.0, "reward_clip": 10.0, "whiten_advantages": True,
                    "kl_coef": 0.001, "kl_estimator": "low_var_kl"}
    assert m.nested()["rollout"] == {"prompts_per_step": 64, "group_size": 8, "max_prompt_tokens": 2048,
                                     "max_new_tokens": 4096}
    report = m.report()
    assert "carried      loss_agg_mode = 'seq-mean-token-sum'  ->  loss.loss_agg_mode: 'seq-mean-token-sum'" in report
    assert "unknown      my_unknown_knob = 3: not a ROLL key this migration knows; not carried" in report
    assert m.carried_keys == set(m.keys) - {"my_unknown_knob"}  # every key of the seed's block, as ROLL runs it
    assert "note         pg_clip is not set: ROLL's default 0.2 applies there" in report
    assert "missing      model.hf_path, rollout.prompts" in report
    # the example is this block on the tiny task: the same loss section
    assert load_config(ROOT / "examples" / "tiny_moe_roll_gspo.yaml").to_dict()["loss"] == \
        config_from_dict({"loss": loss, "model": {"hf_path": "m"}, "rollout": {"prompts": "p"}}).to_dict()["loss"]


def test_verl_yaml_and_overrides_agree_and_match_the_example():
    a, b = migrate("verl", PEERS / "verl_gspo.yaml"), migrate("verl", PEERS / "verl_gspo_overrides.txt")
    assert a.nested() == b.nested()
    loss = a.nested()["loss"]
    assert loss == {"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "advantage_estimator": "grpo",
                    "estimator_args": {"group_std": "unbiased"}}
    assert ("not carried  algorithm.gamma = 1.0: our grpo estimator takes no gamma (only a return estimator "
            "discounts: reinforce, reinforce_plus_plus)") in a.report()
    assert a.nested()["train"]["mini_batches"] == 8 and a.nested()["parallel"] == {"tensor": 2, "expert": 8}
    assert "clip_ratio_c = 10.0: verl's GSPO loss takes no dual clip" in a.report()
    example = load_config(ROOT / "examples" / "tiny_moe_verl_gspo.yaml").loss
    assert all(getattr(example, k) == v for k, v in loss.items())


def test_slime_flags_and_the_example():
    m = migrate("slime", PEERS / "slime_gspo.sh")
    loss = m.nested()["loss"]
    assert loss == {"advantage_estimator": "grpo", "estimator_args": {"group_std": "unbiased"}, "name": "gspo",
                    "eps_low": 3.5e-4, "eps_high": 3.5e-4}
    assert m.nested()["train"]["mini_batches"] == 1  # global batch 16 = 4 prompts x 4
    example = load_config(ROOT / "examples" / "tiny_moe_slime_gspo.yaml").loss
    assert all(getattr(example, k) == v for k, v in loss.items())


@pytest.mark.parametrize("flags,want", [
    ("--advantage-estimator reinforce_plus_plus --kl-coef 0.05 --kl-loss-type k2 --normalize-advantages",
     {"advantage_estimator": "reinforce_plus_plus", "name": "grpo", "whiten_advantages": True,
      "kl_in_reward_coef": 0.05, "kl_in_reward_estimator": "k2"}),
    ("--advantage-estimator grpo --disable-grpo-std-normalization --use-kl-loss --kl-loss-coef 0.01 "
     "--kl-loss-type low_var_kl --eps-clip 0.2 --eps-clip-high 0.28 --eps-clip-c 3 --calculate-per-token-loss",
     {"advantage_estimator": "dr_grpo", "name": "grpo", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0,
      "loss_agg_mode": "token-mean", "kl_coef": 0.01, "kl_estimator": "low_var_kl"}),
])
def test_slime_estimators_kl_and_clips(tmp_path, flags, want):
    f = tmp_path / "flags.sh"
    f.write_text(f"ARGS=(\n   {flags}\n)\n")
    assert migrate("slime", f, ["model.hf_path=m", "rollout.prompts=p"]).nested()["loss"] == want


@pytest.mark.parametrize("text,want", [
    ("adv_estimator: grpo\nnum_return_sequences_in_group: 4\nimportance_sampling: token\n",
     {"advantage_estimator": "grpo", "estimator_args": {"group_std": "unbiased"}, "name": "grpo"}),
    ("adv_estimator: grpo\nadd_token_level_kl: true\ninit_kl_coef: 0.1\nkl_penalty: k3\nimportance_sampling: token\n",
     {"advantage_estimator": "reinforce", "reward_norm_mean": "group", "reward_norm_std": "group", "name": "grpo",
      "kl_in_reward_coef": 0.1, "kl_in_reward_estimator": "low_var_kl"}),
    ("adv_estimator: reinforce\nreward_norm: running\nreward_shift: true\nimportance_sampling: seq\n",
     {"advantage_estimator": "reinforce", "name": "gspo", "reward_norm_mean": "running", "reward_norm_std": None}),
    ("adv_estimator: reinforce\nnorm_mean_type: batch\nnorm_std_type: group\nloss_agg_mode: token-mean\n"
     "importance_sampling: token\npg_clip: 0.1\ndual_clip_loss: true\n",
     {"advantage_estimator": "reinforce", "name": "grpo", "loss_agg_mode": "token-mean", "eps_low": 0.1,
      "eps_high": 0.1, "dual_clip_c": 1.2, "reward_norm_mean": "batch", "reward_norm_std": "group"}),
])
def test_roll_estimators_norms_and_kl(tmp_path, text, want):
    f = tmp_path / "roll.yaml"
    f.write_text(text + "pretrain: m\n")
    m = migrate("roll", f, ["rollout.prompts=p"])
    assert m.nested()["loss"] == want, m.report()


def test_verl_reinforce_plus_plus_with_the_kl_in_the_reward_takes_gspo_token(tmp_path):
    f = tmp_path / "o.txt"
    f.write_text("algorithm.adv_estimator=reinforce_plus_plus\nalgorithm.use_kl_in_reward=True\n"
                 "algorithm.kl_penalty=low_var_kl\nalgorithm.kl_ctrl.kl_coef=0.02\n"
                 "actor_rollout_ref.actor.policy_loss.loss_mode=gspo\nnot an override\n")
    m = migrate("verl", f, ["model.hf_path=m", "rollout.prompts=p"])
    assert m.nested()["loss"] == {"name": "gspo_token", "advantage_estimator": "reinforce_plus_plus",
                                  "kl_in_reward_coef": 0.02, "kl_in_reward_estimator": "low_var_kl"}
    assert "not carried  (line 6) not an override: not a key=value override" in m.report()


def test_readers_and_errors(tmp_path):
    assert _flags("A=(\n --x 1 \\\n --use-kl-loss\n # --y 2\n)\n--z=3 word") == (
        {"x": "1", "use-kl-loss": True, "z": "3"}, ["not carried  (line 6) word: not a --flag"])
    assert override_keys("+a.b=1 \\\n++c=[1,2] 'd.e=[x, y]'\n# x\n", Path("o.txt")) == (
        {"a.b": 1, "c": [1, 2], "d.e": ["x", "y"]}, [])
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "migrate", "--from", "roll",
                           str(tmp_path / "none.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a file" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout_batch_size: 6\nnum_return_sequences_in_group: 1\n")
    with pytest.raises(Exception, match="does not pass the trainer's checks: rollout.group_size=1"):
        migrate("roll", bad)
