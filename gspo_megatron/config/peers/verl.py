"""verl's trainer config (verl/trainer/config/ppo_trainer.yaml, ppo_megatron_trainer.yaml; the
nested actor_rollout_ref / algorithm / data keys) in this project's terms, from a YAML file or a
file of Hydra overrides (`algorithm.adv_estimator=grpo`, one or several per line, `+` / `++`
prefixes), or a recipe's shell script of them (reading.py). Formulas: docs/algorithm.md.

verl's estimators (core_algos compute_*_outcome_advantage) score a response by the sum of its
token rewards (the KL in the reward included: ray_trainer.apply_kl_penalty); its policy losses
take `loss_agg_mode`, the vanilla (PPO) one with a dual clip at clip_ratio_c (3 unless set), the
GSPO one (loss_mode gspo) fixing seq-mean-token-mean and no dual clip.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gspo_megatron.config.parsing import ConfigError
from gspo_megatron.algorithms.advantage.table import ESTIMATORS as ESTIMATOR_ROWS
from gspo_megatron.algorithms.registry import LOSSES as LOSS_ROWS
from gspo_megatron.algorithms.terms import KL_ESTIMATORS
from gspo_megatron.config.peers.migration import Migration, carry_lora, flatten, peer_names, resolve_interpolations
from gspo_megatron.config.peers.reading import (SHELL_VARIABLE, Found, last_wins, read_text, shell_lines, substitute,
                                                yaml_mapping)

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
ESTIMATORS = peer_names(ESTIMATOR_ROWS, "verl")  # verl's adv_estimator names -> ours
KL_KINDS = peer_names(KL_ESTIMATORS, "verl")  # verl's k3 is clamped to [-10, 10]: our low_var_kl
LOSSES = peer_names(LOSS_ROWS, "verl")  # verl's policy_loss.loss_mode -> ours
NO_COUNTERPART = {
    "trainer": "verl's trainer settings (logging, nodes, naming): here the run's folder, TensorBoard and "
               "the launch scripts", "ray_kwargs": "no Ray here", "ray_init": "no Ray here",
    "global_profiler": "not offered", "critic": "no critic here (no GAE)",
    "reward_model": "rewards are functions here (rollout.reward: docs/rewards.md)",
    "custom_reward_function": "rollout.reward: package.module:function here",
    "actor_rollout_ref.ref": "the reference is the policy RL starts from (loss.kl_coef), in the trainer's layout",
    "actor_rollout_ref.hybrid_engine": "SGLang servers beside the trainer here",
    "actor_rollout_ref.model": "the model is model.hf_path (its own config and tokenizer)",
    R: "SGLang's own settings: rollout.server_extra_args here", f"{A}.profiler": "not offered",
    f"{A}.checkpoint": "checkpoints hold everything here (checkpoint.*)", f"{A}.fsdp_config": "megatron-core here",
    f"{A}.megatron": "megatron's own settings: compute.* here", f"{A}.optim": "train.* here",
    f"{A}.policy_loss": "the clip-cov / kl-cov losses are not offered", "data": "the prompt set's own options",
    "algorithm.rollout_correction": "the mismatch corrections are loss.tis_cap, seq_is_cap, mis_cap here",
    "algorithm.pf_ppo": "not offered", "algorithm.filter_groups": "rollout.dynamic_sampling here",
    "algorithm.lam": "GAE's lambda: no critic here", "algorithm.kl_ctrl": "a fixed KL coefficient here",
}


OVERRIDE = re.compile(r"^\+{0,2}([A-Za-z_][\w.]*)=(.*)$", re.S)


def _value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def override_keys(text: str, path: Path) -> tuple[dict[str, Any], list[str]]:
    """Hydra overrides as verl's users hold them: `key=value` words (`+` / `++` prefixes), one or
    several per line, or a recipe's shell script around them (`set -x`, `MODEL=...` assignments used
    as $MODEL, `python3 -m verl.trainer.main_ppo \\`, comments). Returns {key: value} (a repeated
    key: the last value, as Hydra) and a line for each other word of the file and each earlier value."""
    found: Found = []
    lines: list[str] = []
    variables: dict[str, str] = {}
    for line, words in shell_lines(text, path, "verl"):
        if words[0] == "export":
            words = words[1:]
        other = []
        for word in words:
            match = OVERRIDE.match(word)
            if match and SHELL_VARIABLE.match(match.group(1)) and not word.startswith("+"):
                variables[match.group(1)] = substitute(match.group(2), variables)
                lines.append(f"note         (line {line}) {word}: a shell variable, used where the overrides "
                             f"say ${match.group(1)}")
            elif match:
                found.append((match.group(1), _value(substitute(match.group(2), variables)), line))
            else:
                other.append(word)
        if other:
            lines.append(f"not carried  (line {line}) {' '.join(other)}: not a key=value override")
    keys, repeats = last_wins(found, "Hydra")
    return keys, lines + repeats


def _overrides_in(text: str) -> bool:
    """The text holds Hydra override words (a dotted key and `=`), not YAML."""
    return re.search(r"(^|\s)\+{0,2}[A-Za-z_]\w*\.[\w.]*=", text, re.M) is not None


def read(path: Path) -> Migration:
    text = read_text(path, "verl")
    data = yaml_mapping(text, path, "verl", required=not _overrides_in(text))
    if data is not None:
        return Migration("verl", str(path), resolve_interpolations(flatten(data)), known=dict(NO_COUNTERPART))
    keys, lines = override_keys(text, path)
    if not keys:
        raise ConfigError(f"migrate --from verl: {str(path)!r} holds no key=value override (expected verl's YAML, "
                          "Hydra overrides, or a recipe's shell script of them)")
    return Migration("verl", str(path), keys, known=dict(NO_COUNTERPART), reader_lines=lines)


def _unresolved(m: Migration) -> None:
    for key, value in m.keys.items():
        if isinstance(value, str) and ("$" in value):
            m.skip(key, "a shell variable or interpolation this file does not resolve: resolve it first")


def translate(m: Migration) -> None:
    _unresolved(m)
    for key, ours, how in (("data.train_batch_size", "rollout.prompts_per_step", "prompts per step"),
                           ("data.max_prompt_length", "rollout.max_prompt_tokens", "longer prompts are dropped"),
                           ("data.max_response_length", "rollout.max_new_tokens", "the generation budget"),
                           ("data.train_files", "rollout.prompts", "parquet / jsonl"),
                           ("data.val_files", "eval.prompts", "a held-out set"),
                           ("data.prompt_key", "rollout.prompt_key", ""), ("data.shuffle", "rollout.shuffle_prompts", ""),
                           ("actor_rollout_ref.model.path", "model.hf_path", "the initial policy"),
                           (f"{R}.n", "rollout.group_size", "responses per prompt"),
                           (f"{R}.temperature", "rollout.temperature", ""), (f"{R}.top_p", "rollout.top_p", ""),
                           (f"{R}.top_k", "rollout.top_k", ""), (f"{R}.val_kwargs.temperature", "eval.temperature", ""),
                           (f"{R}.val_kwargs.top_p", "eval.top_p", ""), (f"{R}.val_kwargs.n", "eval.samples_per_prompt", ""),
                           (f"{A}.optim.lr", "train.lr", ""), (f"{A}.optim.clip_grad", "train.clip_grad", ""),
                           (f"{A}.grad_clip", "train.clip_grad", ""), (f"{A}.optim.weight_decay", "train.weight_decay", ""),
                           (f"{A}.ppo_micro_batch_size_per_gpu", "train.micro_batch_size", "rows per micro-batch"),
                           (f"{A}.megatron.tensor_model_parallel_size", "parallel.tensor", ""),
                           (f"{A}.megatron.pipeline_model_parallel_size", "parallel.pipeline", ""),
                           (f"{A}.megatron.virtual_pipeline_model_parallel_size", "parallel.virtual_pipeline", ""),
                           (f"{A}.megatron.expert_model_parallel_size", "parallel.expert", ""),
                           (f"{A}.megatron.expert_tensor_parallel_size", "parallel.expert_tensor", ""),
                           (f"{A}.megatron.context_parallel_size", "parallel.context", ""),
                           ("trainer.total_training_steps", "train.steps", "RL steps"),
                           ("trainer.default_local_dir", "checkpoint.dir", "")):
        if m.has(key) and key not in m.taken and m.keys[key] is not None:
            m.carry(key, ours, m.take(key), how)
    if m.take(f"{A}.use_dynamic_bsz"):
        m.carry(f"{A}.ppo_max_token_len_per_gpu", "train.max_tokens_per_micro_batch",
                m.take(f"{A}.ppo_max_token_len_per_gpu", 16384), "use_dynamic_bsz: a token budget per micro-batch")
        m.said(f"{A}.use_dynamic_bsz", "token-budget micro-batches (train.max_tokens_per_micro_batch)")
    else:
        m.said(f"{A}.use_dynamic_bsz", "row-count micro-batches (train.micro_batch_size)")
        m.skip(f"{A}.ppo_max_token_len_per_gpu", "acts only with use_dynamic_bsz")
    if m.keys.get("data.filter_overlong_prompts") and m.has("data.max_prompt_length"):
        m.said("data.filter_overlong_prompts", "rollout.max_prompt_tokens drops longer prompts at load")
    carry_lora(m, "actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
               "actor_rollout_ref.model.target_modules")
    _mini_batches(m)
    loss = _loss(m)
    _estimator(m, loss)
    _kl_loss(m)


def _mini_batches(m: Migration) -> None:
    mini, batch = m.take(f"{A}.ppo_mini_batch_size"), m.keys.get("data.train_batch_size")
    if mini is not None:
        if isinstance(batch, int) and isinstance(mini, int) and mini > 0 and batch % mini == 0:
            m.carry(f"{A}.ppo_mini_batch_size", "train.mini_batches", batch // mini,
                    "data.train_batch_size / ppo_mini_batch_size (both in prompts)")
        else:
            m.skip(f"{A}.ppo_mini_batch_size", "not a divisor of data.train_batch_size: set train.mini_batches")
    epochs = m.take(f"{A}.ppo_epochs", 1)
    if m.has(f"{A}.ppo_epochs") and epochs != 1:
        m.skip(f"{A}.ppo_epochs", "several passes over one rollout batch are not offered")
    elif m.has(f"{A}.ppo_epochs"):
        m.said(f"{A}.ppo_epochs", "one pass over each rollout batch, as here")
    coeff = m.take(f"{A}.entropy_coeff", 0)
    if coeff:
        m.skip(f"{A}.entropy_coeff", "no entropy bonus here")
    elif m.has(f"{A}.entropy_coeff"):
        m.said(f"{A}.entropy_coeff", "no entropy bonus, as here")


def _loss(m: Migration) -> str:
    mode_key = next((k for k in (f"{A}.policy_loss.loss_mode", f"{A}.loss_mode") if m.has(k)), "")
    mode = m.take(mode_key) if mode_key else None
    if mode is not None and mode not in LOSSES:
        m.skip(mode_key, f"verl's {mode!r} loss is not offered (gspo, vanilla = grpo here)")
        mode = None
    loss = LOSSES[mode] if mode is not None else "gspo"  # no loss chosen: this project's default
    per_token = m.keys.get("algorithm.use_kl_in_reward") and m.keys.get("algorithm.adv_estimator") == "reinforce_plus_plus"
    if loss == "gspo" and (per_token or (m.keys.get("algorithm.gamma", 1.0) != 1.0
                                         and m.keys.get("algorithm.adv_estimator") == "reinforce_plus_plus")):
        loss = "gspo_token"
    if mode is not None:
        m.carry(mode_key, "loss.name", loss, "verl's token-form GSPO: GSPO with one advantage per response, "
                "GSPO-token with one per token" if mode == "gspo" else "PPO's token ratios")
    else:
        m.note("policy_loss.loss_mode is not set: verl's default is vanilla (token ratios, grpo here); "
               "loss.name here defaults to gspo, and the vanilla loss's settings (clip_ratio_c, loss_agg_mode) "
               "are not carried to it")
    lo = m.take(f"{A}.clip_ratio_low", m.keys.get(f"{A}.clip_ratio"))
    hi = m.take(f"{A}.clip_ratio_high", m.keys.get(f"{A}.clip_ratio"))
    for key, ours, v in ((f"{A}.clip_ratio_low", "loss.eps_low", lo), (f"{A}.clip_ratio_high", "loss.eps_high", hi)):
        if v is not None:
            m.carry(key, ours, float(v), "")
    if m.has(f"{A}.clip_ratio"):
        m.said(f"{A}.clip_ratio", "loss.eps_low / eps_high where clip_ratio_low / clip_ratio_high are not set")
    if lo is None and hi is None:
        m.note("clip_ratio is not set: verl's default 0.2 applies there; here loss.eps_low / eps_high default to "
               "the paper's for the loss")
    c = m.take(f"{A}.clip_ratio_c")
    if loss == "grpo":
        m.carry(f"{A}.clip_ratio_c", "loss.dual_clip_c", _number(m, f"{A}.clip_ratio_c", 3.0),
                "verl's vanilla loss always dual-clips negative advantages (3 unless set)")
    elif c is not None:
        m.skip(f"{A}.clip_ratio_c", "verl's GSPO loss takes no dual clip (compute_policy_loss_gspo)" if mode else
               "verl's vanilla loss's dual clip, and this config trains gspo (loss_mode is not set): set "
               "loss.dual_clip_c to keep one")
    agg = m.take(f"{A}.loss_agg_mode")
    if loss.startswith("gspo"):
        if agg == "seq-mean-token-mean":
            m.said(f"{A}.loss_agg_mode", "GSPO's own aggregation, as here")
        elif agg is not None:
            m.skip(f"{A}.loss_agg_mode", "verl's GSPO loss fixes seq-mean-token-mean whatever this says, as here "
                                         "(Eq. 5)" if mode else "the vanilla loss's, and this config trains gspo "
                                         "(loss_mode is not set) with the paper's seq-mean-token-mean (Eq. 5)")
    elif agg is not None:
        m.carry(f"{A}.loss_agg_mode", "loss.loss_agg_mode", agg, "verl's agg_loss mode")
        if agg == "seq-mean-token-sum-norm":
            _token_sum_norm(m)
    else:
        m.note("loss_agg_mode is not set: verl's default is token-mean; here seq-mean-token-mean")
    if f"{A}.loss_scale_factor" not in m.named:
        m.skip(f"{A}.loss_scale_factor", "acts only with seq-mean-token-sum-norm")
    return loss


def _number(m: Migration, key: str, default: float) -> float:
    """The key's value as a number (default when absent); ConfigError naming it otherwise."""
    value = m.keys.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"migrate --from verl: {key}={value!r}: expected a number") from None


def _token_sum_norm(m: Migration) -> None:
    """seq-mean-token-sum-norm's C: verl's loss_scale_factor, else the padded response width
    (data.max_response_length)."""
    key = next((k for k in (f"{A}.loss_scale_factor", "data.max_response_length")
                if isinstance(m.keys.get(k), (int, float)) and not isinstance(m.keys.get(k), bool)), None)
    if key is None:
        if m.overridden("loss.aggregation_args.token_sum_norm"):
            m.note("seq-mean-token-sum-norm: C is the --set loss.aggregation_args.token_sum_norm")
            return
        raise ConfigError(f"migrate --from verl: {A}.loss_agg_mode=seq-mean-token-sum-norm divides by "
                          "loss_scale_factor, else by data.max_response_length, and this file gives neither as a "
                          "number: add one, or --set loss.aggregation_args.token_sum_norm=C")
    if key == f"{A}.loss_scale_factor":
        m.carry(key, "loss.aggregation_args.token_sum_norm", float(m.take(key)), "C")
    else:
        m.also(f"{A}.loss_agg_mode", "loss.aggregation_args.token_sum_norm", float(m.keys[key]), f"C = {key}")
    m.note("seq-mean-token-sum-norm: verl sums each micro-batch's token sums over C with no mean over the "
           "sequences: its gradient is this one's times the micro-batch's rows (docs/algorithm.md)")


def _estimator(m: Migration, loss: str) -> None:
    est = m.take("algorithm.adv_estimator")
    by_std = m.take("algorithm.norm_adv_by_std_in_grpo", True)
    if est is None:
        m.note("algorithm.adv_estimator is not set: verl's default is gae (a critic); here grpo")
    elif est in ESTIMATORS:
        ours = "dr_grpo" if ESTIMATORS[est] == "grpo" and not by_std else ESTIMATORS[est]
        m.carry("algorithm.adv_estimator", "loss.advantage_estimator", ours, "verl's core_algos estimator"
                + (" without the std (norm_adv_by_std_in_grpo: false)" if ours == "dr_grpo" else ""))
        if ours == "grpo":
            m.also("algorithm.adv_estimator", "loss.estimator_args.group_std", "unbiased", "torch.std")
        if ours == "reinforce_plus_plus":
            m.note("verl's REINFORCE++ return stops at every untrained position (a multi-turn episode's environment "
                   "tokens), so an earlier turn gets none of the later rewards; here it sums through them, as "
                   "ROLL's: the same on single-turn responses (docs/algorithm.md)")
        m.said("algorithm.norm_adv_by_std_in_grpo", "the estimator above")
    else:
        m.skip("algorithm.adv_estimator", f"verl's {est!r} is not offered here (estimators: docs/algorithm.md)")
    if m.has("algorithm.gamma"):
        m.estimator_setting("algorithm.gamma", "gamma", float(m.take("algorithm.gamma")), "the return-to-go's discount")
    if m.take("algorithm.use_kl_in_reward", False):
        coef = float(m.take("algorithm.kl_ctrl.kl_coef", 0.001))
        m.carry("algorithm.use_kl_in_reward", "loss.kl_in_reward_coef", coef, "beta = kl_ctrl.kl_coef: "
                "token_level_rewards = scores - beta KL(pi_old || pi_ref)")
        m.said("algorithm.kl_ctrl.kl_coef", "beta above")
        kind = m.take("algorithm.kl_penalty", "kl")
        if kind in KL_KINDS:
            m.carry("algorithm.kl_penalty", "loss.kl_in_reward_estimator", KL_KINDS[kind], "verl's kl_penalty kind")
        else:
            m.skip("algorithm.kl_penalty", f"{kind!r} is not offered ({KL_ESTIMATORS.names_text()})")
        if m.take("algorithm.kl_ctrl.type", "fixed") != "fixed":
            m.skip("algorithm.kl_ctrl.type", "an adaptive KL coefficient is not offered")
    else:
        if m.has("algorithm.use_kl_in_reward"):
            m.said("algorithm.use_kl_in_reward", "loss.kl_in_reward_coef: 0 (off)")
        for key in ("algorithm.kl_penalty", "algorithm.kl_ctrl.kl_coef"):
            m.skip(key, "acts only with use_kl_in_reward")


def _kl_loss(m: Migration) -> None:
    if m.take(f"{A}.use_kl_loss", False):
        m.carry(f"{A}.kl_loss_coef", "loss.kl_coef", float(m.take(f"{A}.kl_loss_coef", 0.001)),
                "agg_loss(kl, loss_agg_mode) * kl_loss_coef")
        kind = m.take(f"{A}.kl_loss_type", "low_var_kl")
        if kind in KL_KINDS:
            m.carry(f"{A}.kl_loss_type", "loss.kl_estimator", KL_KINDS[kind], "verl's kl_penalty kind")
        else:
            m.skip(f"{A}.kl_loss_type", f"{kind!r} (a straight-through k2 gradient) is not offered")
    else:
        if m.has(f"{A}.use_kl_loss"):
            m.said(f"{A}.use_kl_loss", "loss.kl_coef: 0 (off)")
        for key in (f"{A}.kl_loss_coef", f"{A}.kl_loss_type"):
            m.skip(key, "acts only with use_kl_loss")
