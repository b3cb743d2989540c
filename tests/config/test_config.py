"""Run config: YAML + `--set` overrides, typed parsing, validation errors that name field and value."""
from __future__ import annotations

import pytest

from gspo_megatron.config import (ConfigError, RunConfig, config_from_dict, describe_fields,
                                  field_docs, load_config, parse_override)
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.algorithms.terms import Aggregation, TokenSumNorm

BASE = {"model": {"hf_path": "/m"}, "rollout": {"prompts": "p.jsonl"}}


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {hf_path: /m}\nrollout: {prompts: p.jsonl, group_size: 4}\n"
                 "train: {lr: 1e-5, steps: 7}\n")
    cfg = load_config(f, ["parallel.tensor=2", "rollout.server_urls=[http://a:1, http://b:2]",
                          "train.use_distributed_optimizer=true", "loss.eps_high=0.001",
                          "checkpoint.dir=/tmp/ck", "parallel.virtual_pipeline=null"])
    assert cfg.train.lr == 1e-5 and cfg.train.steps == 7 and cfg.rollout.group_size == 4
    assert cfg.parallel.tensor == 2 and isinstance(cfg.parallel, ParallelLayout)
    assert cfg.rollout.server_urls == ["http://a:1", "http://b:2"]
    assert cfg.train.use_distributed_optimizer is True
    assert cfg.loss.clip_range() == (3e-4, 0.001)
    assert cfg.checkpoint.dir == "/tmp/ck" and cfg.parallel.virtual_pipeline is None


@pytest.mark.parametrize("name,lo,hi", [("gspo", 3e-4, 4e-4), ("gspo_token", 3e-4, 4e-4),
                                        ("grpo", 0.2, 0.27)])
def test_per_loss_default_clip_ranges_are_the_papers(name, lo, hi):
    cfg = config_from_dict(BASE, [f"loss.name={name}"])
    assert cfg.loss.clip_range() == (lo, hi)
    text = cfg.describe_loss()
    assert f"loss={name}" in text and f"eps_low={lo:g}" in text and f"eps_high={hi:g}" in text


def test_typed_parse_of_overrides():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=1.5e-6") == (["a"], 1.5e-6)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=x=y") == (["a"], "x=y")
    cfg = config_from_dict(BASE, ["train.lr=1e-6", "train.min_lr=0", "rollout.server_urls=http://h:1"])
    assert cfg.train.lr == 1e-6 and isinstance(cfg.train.min_lr, float)
    assert cfg.rollout.server_urls == ["http://h:1"]


@pytest.mark.parametrize("override,needle", [
    ("train.stepz=3", "unknown key 'train.stepz' (did you mean 'steps'?)"),
    ("trian.steps=3", "unknown key 'trian'"),
    ("train.steps=abc", "train.steps='abc': expected int"),
    ("train.steps=1.5", "train.steps=1.5: expected int"),
    ("loss.name=ppo", "loss.name='ppo': expected one of gspo, gspo_token, grpo, or package.module:Name naming a LossSpec"),
    ("train.old_log_probs=cached", "train.old_log_probs='cached'"),
    ("train.mini_batches=3", "train.mini_batches=3: expected a divisor of the rollout batch"),
    ("rollout.temperature=0", "rollout.temperature=0.0: expected > 0"),
    ("rollout.group_size=0", "rollout.group_size=0: expected >= 2: loss.advantage_estimator=grpo is relative to "
                             "the prompt's group"),
    ("parallel.tensor=0", "parallel.tensor=0: expected >= 1"),
    ("rollout.server_urls=[h:30000]", "rollout.server_urls='h:30000': expected URLs"),
    ("train.use_distributed_optimizer=maybe", "train.use_distributed_optimizer='maybe': expected bool"),
    ("rollout.mask_stale_tokens=true", "rollout.mask_stale_tokens=True: expected false unless"),
    ("train", "expected KEY=VALUE"),
    ("train.steps.x=1", "train.steps={'x': 1}: expected int"),
    ("train.x.y=1", "unknown key 'train.x'"),
    ("loss.tis_cap=0.5", "tis_cap=0.5: expected >= 1"),
    ("loss.mis_level=row", "loss.mis_level='row': expected 'token' | 'sequence'"),
    ("moe.replay=maybe", "moe.replay='maybe': expected bool"),
])
def test_bad_values_name_field_and_value(override, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE, [override])
    assert needle in str(e.value)


def test_missing_required_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="model.hf_path"):
        config_from_dict({"rollout": {"prompts": "p"}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)
    bad.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_config(bad)


def test_every_field_has_a_docstring():
    import dataclasses
    from typing import get_type_hints
    hints = get_type_hints(RunConfig)
    assert set(field_docs(RunConfig)) == {f.name for f in dataclasses.fields(RunConfig)}
    for f in dataclasses.fields(RunConfig):
        cls = hints[f.name]
        if not dataclasses.is_dataclass(cls):  # a top-level field (plugins), not a section
            continue
        assert set(field_docs(cls)) == {g.name for g in dataclasses.fields(cls)}, cls.__name__
    text = describe_fields()
    assert "rollout:" in text and "group_size: 8" in text and "mini_batches: 4" in text


@pytest.mark.parametrize("overrides,needle", [
    (["loss.tis_cap=2", "train.old_log_probs=engine"], "loss.tis_cap=2.0: expected null with train.old_log_probs=engine"),
    (["moe.drift=true", "train.old_log_probs=engine"], "moe.drift=True: expected false or null"),
    (["moe.replay=true", "moe.engine_routing=false"], "moe.engine_routing=False: expected true or null"),
])
def test_moe_and_mismatch_cross_checks(overrides, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE, overrides)
    assert needle in str(e.value)
    ok = config_from_dict(BASE, ["loss.tis_cap=2", "loss.mis_cap=3", "loss.mis_level=sequence"])
    assert "tis_cap=2 mis_cap=3" in ok.describe_loss()


@pytest.mark.parametrize("overrides,needle", [
    (["loss.advantage_estimator=ppo"], "loss.advantage_estimator='ppo': expected one of grpo, dr_grpo, rloo"),
    (["loss.name=grpo", "loss.loss_agg_mode=seq-mean-token-sum-norm"],
     "loss.aggregation_args.token_sum_norm=0.0: expected > 0"),
    (["loss.aggregation_args.token_sum_norm=4"], "loss.aggregation_args={'token_sum_norm': 4}: "
                                                 "'seq-mean-token-mean' takes no settings of its own"),
    (["loss.token_sum_norm=4"], "loss.token_sum_norm=4: moved; write loss.aggregation_args: {token_sum_norm: ...}"),
    (["loss.group_std=unbiased"], "loss.group_std='unbiased': moved; write loss.estimator_args: {group_std: ...}"),
    (["loss.advantage_estimator=rloo", "loss.estimator_args.group_std=unbiased"],
     "loss.estimator_args={'group_std': 'unbiased'}: 'rloo' takes no settings of its own"),
    (["loss.estimator_args.gamma=0.9"], "unknown key 'loss.estimator_args.gamma'; known: group_std"),
    (["loss.dual_clip_c=1"], "loss.dual_clip_c=1.0: expected > 1"),
    (["loss.kl_estimator=full"], "loss.kl_estimator='full': expected one of k1, k2, k3, low_var_kl, abs"),
    (["loss.advantage_estimator=reinforce", "loss.estimator_args.gamma=0"],
     "loss.estimator_args.gamma=0.0: expected in (0, 1]"),
    (["rollout.code_sandbox.memory_mb=5"], "rollout.code_sandbox={'memory_mb': 5}: moved; write rollout.reward_args"),
    (["rollout.reward=code", "rollout.reward_args.memory_mb=0"], "rollout.reward_args.memory_mb=0: expected >= 1"),
    (["rollout.reward_args.memory_mb=5"], "rollout.reward_args={'memory_mb': 5}: 'math' takes no settings of its own"),
    (["sync.transport_args.x=1"], "sync.transport_args={'x': 1}: 'disk' takes no settings of its own"),
    (["loss.name=ce"], "loss.name='ce': expected one of gspo, gspo_token, grpo, or package.module:Name"),
    (["plugins=[no_such_module]"], "plugins[0]='no_such_module': cannot import it (ModuleNotFoundError"),
    (["loss.name=gspo_megatron.algorithms.registry:GSPO_CLIP"], "loss.name='gspo_megatron.algorithms.registry:GSPO_CLIP': "
                                                            "(0.0003, 0.0004) is not a loss (expected a LossSpec)"),
    (["loss.advantage_clip=0"], "loss.advantage_clip=0.0: expected > 0"),
    (["loss.reward_norm_mean=domain"], "loss.reward_norm_mean='domain'"),
    (["loss.advantage_estimator=rloo", "rollout.group_size=1"], "rollout.group_size=1: expected >= 2"),
    (["loss.name=gspo_token", "loss.kl_in_reward_coef=0.1", "rollout.environment=calculator",
      "rollout.turn_credit=return_to_go"], "loss.kl_in_reward_coef=0.1: expected 0 with rollout.turn_credit"),
    (["loss.name=gspo_token", "loss.reward_clip=1", "rollout.environment=calculator",
      "rollout.turn_credit=return_to_go"], "loss.reward_clip=1.0: expected null with rollout.turn_credit"),
    # a group of one is refused naming the field that makes the advantages group-relative
    (["loss.advantage_estimator=reinforce", "loss.reward_norm_mean=group", "rollout.group_size=1"],
     "rollout.group_size=1: expected >= 2: loss.reward_norm_mean=group subtracts the mean of the prompt's group"),
    (["loss.advantage_estimator=reinforce", "loss.reward_norm_std=group", "rollout.group_size=1"],
     "rollout.group_size=1: expected >= 2: loss.reward_norm_std=group divides each reward by the std of its "
     "prompt's group, which a group of one does not have (NaN advantages)"),
    # a batch statistic over one response: NaN (std) or exactly 0 (mean, whitening)
    *[(["loss.advantage_estimator=reinforce", "rollout.group_size=1", "rollout.prompts_per_step=1",
        "train.mini_batches=1", *sets], needle) for sets, needle in (
        (["loss.reward_norm_std=batch"], "loss.reward_norm_std='batch': expected null or running with one response "
                                         "per rollout batch (rollout.prompts_per_step=1 x rollout.group_size=1): the "
                                         "std of a single reward is undefined (NaN advantages)"),
        (["loss.reward_norm_mean=batch"], "loss.reward_norm_mean='batch': expected null or running with one response"),
        (["loss.whiten_advantages=true"], "loss.whiten_advantages=True: expected false with one response per "
                                          "rollout batch"),
        (["loss.advantage_estimator=reinforce_plus_plus"], "loss.advantage_estimator='reinforce_plus_plus': "
                                                           "expected an estimator that does not whiten"))],
    # a reward name mistyped for the eval is named as the eval's
    (["eval.reward=exact_matc"], "eval.reward='exact_matc': expected one of math, exact_match"),
    # a knob the rest of the config makes inert is named, not ignored
    (["loss.kl_estimator=k2"], "loss.kl_estimator='k2': acts only with loss.kl_coef > 0, which is 0.0"),
    (["loss.kl_in_reward_estimator=k2"], "loss.kl_in_reward_estimator='k2': acts only with loss.kl_in_reward_coef > 0"),
    (["loss.advantage_estimator=reinforce_plus_plus_baseline", "loss.whiten_advantages=false"],
     "loss.whiten_advantages=false: loss.advantage_estimator=reinforce_plus_plus_baseline whitens its advantages "
     "over the batch whatever this says"),
])
def test_advantage_and_aggregation_rules(overrides, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(BASE, overrides)
    assert needle in str(e.value)


def test_gspo_takes_roll_seq_aggregations_and_per_token_advantages():
    """ROLL's importance_sampling: seq with its loss_agg_mode, and with per-token advantages (a
    discounted return, the KL in the reward): gspo takes them; the paper's aggregation by default."""
    assert config_from_dict(BASE).loss.function_kwargs() == dict(eps_low=3e-4, eps_high=4e-4)
    cfg = config_from_dict(BASE, ["loss.loss_agg_mode=seq-mean-token-sum", "loss.advantage_estimator=reinforce",
                                  "loss.estimator_args.gamma=0.9"])
    assert cfg.describe_loss().startswith("loss=gspo seq-mean-token-sum eps_low=0.0003 eps_high=0.0004 KL off | "
                                          "advantage=reinforce gamma=0.9")
    assert cfg.loss.per_token() and cfg.loss.spec.takes_token_advantages


def test_advantage_settings_accepted_and_described():
    cfg = config_from_dict(BASE, ["loss.name=grpo", "loss.loss_agg_mode=seq-mean-token-sum-norm",
                                  "loss.aggregation_args.token_sum_norm=64", "loss.dual_clip_c=3",
                                  "loss.advantage_estimator=reinforce", "loss.estimator_args.gamma=0.95",
                                  "loss.kl_in_reward_coef=0.01", "loss.whiten_advantages=true",
                                  "rollout.group_size=1", "loss.advantage_clip=2"])
    assert cfg.describe_loss().startswith(
        "loss=grpo seq-mean-token-sum-norm (token_sum_norm=64) eps_low=0.2 eps_high=0.27 dual_clip_c=3 KL off | "
        "advantage=reinforce gamma=0.95 KL in reward 0.01 (k1) whitened advantage_clip=2")
    assert cfg.loss.reference_reason == "loss.kl_in_reward_coef=0.01"  # the reference pass runs
    assert cfg.loss.function_kwargs() == dict(eps_low=0.2, eps_high=0.27, dual_clip_c=3.0, loss_agg_mode=Aggregation(
        "seq-mean-token-sum-norm", TokenSumNorm(64.0)))
    assert config_from_dict(BASE).loss.function_kwargs() == dict(eps_low=3e-4, eps_high=4e-4)  # a new row's contract
