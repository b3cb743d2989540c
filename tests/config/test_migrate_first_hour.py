"""`gspo-megatron migrate` as a new user meets it: the files users bring (ROLL's full pipeline YAML,
verl's recipe scripts, slime's flag arrays) and their mistakes. Each refusal is one line naming the
key or the line, exit 2, no traceback; each accepted file names every key and ends on a summary."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gspo_megatron.cli import main

ROLL_PIPELINE = """\
pretrain: Qwen/Qwen2.5-7B
sequence_length: 8192
prompt_length: 2048
adv_estimator: reinforce
importance_sampling: seq
loss_agg_mode: seq-mean-token-sum
num_return_sequences_in_group: 8
rollout_batch_size: 64
eval_steps: 10
actor_train:
  training_args:
    learning_rate: 1.0e-6
    warmup_steps: 20
  data_args:
    file_name: [data/math.jsonl, data/code.jsonl]
    messages: messages
  strategy_args:
    strategy_name: megatron_train
    strategy_config:
      tensor_model_parallel_size: 2
      expert_model_parallel_size: 4
validation:
  data_args:
    file_name: [data/math_benchmarks.jsonl]
  generating_args:
    temperature: 0.6
"""
VERL_RECIPE = """\
set -x
# GSPO on GSM8K, as verl's recipes hold it
MODEL=/models/Qwen3-8B
export VLLM_USE_V1=1

python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=/data/gsm8k/train.parquet data.max_response_length=1024 \\
    actor_rollout_ref.model.path=$MODEL \\
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo \\
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.rollout.n=8 $@
"""


def run(capsys, peer: str, path: Path, *sets: str) -> tuple[int, str, str]:
    """The command in this process: (exit code, stdout, stderr); never a traceback."""
    args = ["migrate", "--from", peer, str(path)]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def refused(capsys, peer: str, path: Path) -> str:
    code, out, err = run(capsys, peer, path)
    lines = err.strip().splitlines()
    assert code == 2 and not out and len(lines) == 1 and lines[0].startswith("gspo-megatron: error: migrate"), err
    return lines[0]


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    f = tmp_path / name
    f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
    return f


def test_roll_pipeline_yaml_carries_data_layout_warm_up_and_the_budget(tmp_path, capsys):
    code, out, err = run(capsys, "roll", write(tmp_path, "rlvr.yaml", ROLL_PIPELINE))
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["rollout"]["prompts"] == ["data/math.jsonl", "data/code.jsonl"]
    assert cfg["rollout"]["prompt_key"] == "messages" and cfg["rollout"]["max_new_tokens"] == 8192 - 2048
    assert cfg["train"]["lr_warmup_steps"] == 20 and cfg["parallel"] == {"tensor": 2, "expert": 4}
    assert cfg["eval"] == {"prompts": ["data/math_benchmarks.jsonl"], "temperature": 0.6, "interval": 10}
    assert cfg["loss"] == {"advantage_estimator": "reinforce", "name": "gspo", "loss_agg_mode": "seq-mean-token-sum"}
    assert "missing" not in err and "unknown" not in err.replace("0 unknown", "")
    assert err.strip().splitlines()[-1] == "[migrate] summary      18 keys read: 17 carried, 1 not carried, 0 unknown"


def test_verl_recipe_script_with_several_overrides_a_line(tmp_path, capsys):
    code, out, err = run(capsys, "verl", write(tmp_path, "run_gspo.sh", VERL_RECIPE))
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["model"]["hf_path"] == "/models/Qwen3-8B"  # $MODEL from the script's own assignment
    assert cfg["rollout"]["prompts"] == "/data/gsm8k/train.parquet" and cfg["rollout"]["max_new_tokens"] == 1024
    assert cfg["train"]["lr"] == 1e-6 and cfg["rollout"]["group_size"] == 8 and cfg["loss"]["name"] == "gspo"
    assert "not carried  (line 1) set -x: not a key=value override" in err
    assert "not carried  (line 6) python3 -m verl.trainer.main_ppo $@: not a key=value override" in err


@pytest.mark.parametrize("text,needle", [
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla\nactor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm\n",
     "loss_agg_mode=seq-mean-token-sum-norm divides by loss_scale_factor, else by data.max_response_length, and "
     "this file gives neither as a number"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla data.max_response_length=$RESP\n"
     "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm\n", "gives neither as a number"),
    ("", "is empty (only blanks and comments): nothing to migrate"),
    ("# only a comment\n", "is empty"),
])
def test_verl_refusals_name_the_key(tmp_path, capsys, text, needle):
    assert needle in refused(capsys, "verl", write(tmp_path, "o.txt", text))


def test_verl_unresolved_variable_is_named_not_a_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "verl", write(tmp_path, "o.txt", "actor_rollout_ref.model.path=$MODEL\n"
                                                                "algorithm.adv_estimator=grpo\n"))
    assert code == 0
    assert "not carried  actor_rollout_ref.model.path = '$MODEL': a shell variable or interpolation" in err


def test_verl_without_loss_mode_trains_gspo_without_vanillas_dual_clip(tmp_path, capsys):
    code, out, err = run(capsys, "verl", write(tmp_path, "o.txt", "algorithm.adv_estimator=grpo\n"
                                                                  "actor_rollout_ref.actor.clip_ratio_c=3\n"))
    assert code == 0
    assert "dual_clip_c" not in out and yaml.safe_load(out).get("loss", {}).get("name", "gspo") == "gspo"
    assert "not carried  actor_rollout_ref.actor.clip_ratio_c = 3: verl's vanilla loss's dual clip" in err


@pytest.mark.parametrize("text,needle", [
    ("--n-samples-per-prompt eight\n", "--n-samples-per-prompt 'eight': expected an integer"),
    ('--prompt-data "/data/x.jsonl\n', "line 1: No closing quotation (an unclosed quote)"),
    ("--use-kl-loss --kl-loss-type k4\n", "--kl-loss-type 'k4': expected one of k1, k2, k3, low_var_kl"),
    ("--eps-clip wide\n", "--eps-clip 'wide': expected a number"),
    (b"\x7fELF\x02\x01\x01\x00\xf0\x9f\x00", "is not a text file"),
])
def test_slime_bad_values_are_one_line(tmp_path, capsys, text, needle):
    assert needle in refused(capsys, "slime", write(tmp_path, "flags.sh", text))


def test_a_repeated_key_names_the_value_it_drops(tmp_path, capsys):
    code, out, err = run(capsys, "slime", write(tmp_path, "flags.sh", "--lr 1e-6\n--eps-clip 0.2\n--lr 2e-6\n"))
    assert code == 0 and yaml.safe_load(out)["train"]["lr"] == 2e-6
    assert "not carried  lr = '1e-6' (line 1): given again on line 3; slime's argparse keeps the last value, '2e-6'" in err
    code, _, err = run(capsys, "verl", write(tmp_path, "o.txt", "data.train_batch_size=8 data.train_batch_size=16\n"))
    assert code == 0 and "not carried  data.train_batch_size = 8 (line 1): given again on line 1; Hydra keeps" in err
    line = refused(capsys, "roll", write(tmp_path, "r.yaml", "adv_estimator: grpo\npg_clip: 0.1\npg_clip: 0.2\n"))
    assert "the key 'pg_clip' appears twice (lines 2 and 3)" in line


def test_slime_adam_betas_and_the_kl_type_named_once(tmp_path, capsys):
    code, out, err = run(capsys, "slime", write(tmp_path, "flags.sh", (
        "--adam-beta1 0.9 --adam-beta2 0.98\n--advantage-estimator reinforce_plus_plus --normalize-advantages "
        "--kl-coef 0.05 --kl-loss-type k2\n")))
    cfg = yaml.safe_load(out)
    assert code == 0 and cfg["train"]["adam_beta1"] == 0.9 and cfg["train"]["adam_beta2"] == 0.98
    assert cfg["loss"]["kl_in_reward_estimator"] == "k2"
    said = [ln for ln in err.splitlines() if " kl-loss-type = " in ln]
    assert len(said) == 1 and said[0].startswith("[migrate] carried      kl-loss-type = 'k2'"), said


def test_another_peers_file_is_refused_naming_the_peer(tmp_path, capsys):
    roll = Path(__file__).parent / "peer_configs" / "roll_gspo.yaml"
    line = refused(capsys, "verl", roll)
    assert "none of its 19 keys is a verl key this migration carries; it reads as a ROLL file" in line
    assert line.endswith("--from roll")
    slime = Path(__file__).parent / "peer_configs" / "slime_gspo.sh"
    assert refused(capsys, "roll", slime).endswith("--from slime")
    verl = Path(__file__).parent / "peer_configs" / "verl_gspo.yaml"
    assert "it reads as a verl file" in refused(capsys, "roll", verl)
