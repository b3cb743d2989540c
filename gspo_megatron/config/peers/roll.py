"""ROLL's pipeline YAML (roll/configs/base_config.py PPOConfig, roll/pipeline/rlvr/rlvr_config.py
RLVRConfig; alibaba/ROLL 2025) in this project's terms. Formulas: docs/algorithm.md.

ROLL's order is reward_postprocess (norm, clip), compute_token_reward (the KL in the reward, the
token clip), compute_advantage (returns, whitening, clip): algorithms/advantage/pipeline.py runs the
same steps. Its `grpo` estimator is `reinforce` after a group norm of the rewards; its actor loss is
`importance_sampling` (token: GRPO's ratio, seq: GSPO's) with `dual_clip_loss` at c = 1 + 2 pg_clip.
"""
from __future__ import annotations

from pathlib import Path

from gspo_megatron.algorithms.terms import KL_ESTIMATORS
from gspo_megatron.config.peers.migration import (Migration, carry_lora, flatten, peer_names, read_yaml,
                                                  resolve_interpolations)

KL_KINDS = peer_names(KL_ESTIMATORS, "roll")  # ROLL's kl_penalty kinds -> ours (its k3 is clamped at 10)
DEFAULT_PG_CLIP = 0.2
NO_COUNTERPART = {
    "hydra": "Hydra's own settings", "defaults": "Hydra's defaults list",
    "exp_name": "run naming: the run is its checkpoint.dir here",
    "logging_dir": "logging.tensorboard_dir here", "output_dir": "checkpoint.dir here",
    "system_envs": "environment variables: set them in the launch script (launch/)",
    "checkpoint_config": "checkpoint.dir here", "track_with": "TensorBoard here (logging.tensorboard_dir)",
    "tracker_kwargs": "TensorBoard here (logging.tensorboard_dir)",
    "num_gpus_per_node": "the launch's node shape (launch/), not the run config",
    "save_steps": "checkpoint.interval here (set it)", "logging_steps": "every step is logged here",
    "eval_steps": "eval.interval here (set it)", "resume_from_checkpoint": "a run resumes from checkpoint.dir/latest here",
    "reward_pretrain": "rewards are functions here (rollout.reward), not a model",
    "validation": "eval.* here (a held-out prompt set)", "rewards": "rollout.reward here (a shipped one, an HTTP "
    "service or your function: `gspo-megatron config`, docs/rewards.md)",
    "actor_train": "ROLL's worker settings: the layout is parallel.*, the optimizer train.* here",
    "actor_infer": "ROLL's inference workers: SGLang servers here (rollout.*)",
    "reference": "the reference policy is the policy RL starts from here (loss.kl_coef)",
    "critic": "no critic here (no GAE)", "value_clip": "no critic here", "critic_warmup": "no critic here",
    "lambd": "GAE's lambda: no critic here",
    "l2": "train.weight_decay here (decoupled, not an L2 loss term)",
    "async_generation_ratio": "train.max_staleness here (in weight versions, not a ratio)",
    "whiten_rewards": "not offered: the rewards are normalised by reward_norm_* here",
    "use_reward_scaling": "the reward norm is loss.reward_norm_mean / reward_norm_std here",
    "use_reward_norm": "the reward norm is loss.reward_norm_mean / reward_norm_std here",
    "entropy_loss_coef": "no entropy bonus here", "max_len_mask": "not offered",
    "difficulty_mask": "rollout.dynamic_sampling drops groups of equal rewards here",
    "enable_reference": "the reference exists whenever a KL needs it here",
}


def read(path: Path) -> Migration:
    data = read_yaml(path, "roll")
    if not isinstance(data, dict):
        from gspo_megatron.config.parsing import ConfigError
        raise ConfigError(f"migrate --from roll: {str(path)!r} is not a YAML mapping of ROLL's keys")
    return Migration("roll", str(path), resolve_interpolations(flatten(data)), known=dict(NO_COUNTERPART))


def translate(m: Migration) -> None:
    _sizes(m)
    carry_lora(m, "actor_train.model_args.lora_rank", "actor_train.model_args.lora_alpha",
               "actor_train.model_args.lora_target")
    token_kl = bool(m.take("add_token_level_kl", False))
    gamma = float(m.take("gamma", 1.0))
    _estimator(m, token_kl, gamma)
    per_token = token_kl or gamma < 1
    loss = _loss(m, per_token)
    _clips(m, loss)
    _reward_norm(m)
    _kl(m, token_kl, loss)


def _sizes(m: Migration) -> None:
    for key, ours, how in (("rollout_batch_size", "rollout.prompts_per_step", "prompts per rollout batch"),
                           ("num_return_sequences_in_group", "rollout.group_size", "responses per prompt"),
                           ("prompt_length", "rollout.max_prompt_tokens", "longer prompts are dropped at load"),
                           ("response_length", "rollout.max_new_tokens", "the generation budget"),
                           ("max_steps", "train.steps", "RL steps"), ("seed", "train.seed", ""),
                           ("pretrain", "model.hf_path", "the initial policy"),
                           ("max_grad_norm", "train.clip_grad", "gradient norm clip"),
                           ("actor_train.training_args.learning_rate", "train.lr", ""),
                           ("actor_train.training_args.weight_decay", "train.weight_decay", ""),
                           ("actor_infer.generating_args.temperature", "rollout.temperature", ""),
                           ("actor_infer.generating_args.top_p", "rollout.top_p", ""),
                           ("actor_infer.generating_args.top_k", "rollout.top_k", "")):
        if m.has(key):
            m.carry(key, ours, m.take(key), how)
    for key, same in (("actor_infer.generating_args.max_new_tokens", "response_length"),
                      ("actor_infer.generating_args.num_return_sequences", "num_return_sequences_in_group")):
        if m.has(key):
            if m.has(same) and m.take(key) == m.keys[same]:
                m.said(key, f"as {same} (the same value)")
            else:
                m.skip(key, f"differs from {same}: set the rollout field from one of them")
    epochs = m.take("ppo_epochs", 1)
    if m.has("ppo_epochs"):
        if epochs == 1:
            m.said("ppo_epochs", "one pass over each rollout batch (train.mini_batches updates), as here")
        else:
            m.skip("ppo_epochs", "several passes over one rollout batch are not offered (one pass, "
                                 "train.mini_batches updates)")


def _estimator(m: Migration, token_kl: bool, gamma: float) -> None:
    est = m.take("adv_estimator")
    if est is None:
        m.note("adv_estimator is not set: ROLL's default is gae (a critic); here loss.advantage_estimator "
               "defaults to grpo")
        return
    if est == "reinforce":
        m.carry("adv_estimator", "loss.advantage_estimator", "reinforce",
                "the return-to-go of the token rewards, ROLL compute_reinforce_return")
    elif est == "grpo":
        if token_kl or gamma < 1:  # ROLL's grpo: reinforce after the group norm of the rewards
            m.carry("adv_estimator", "loss.advantage_estimator", "reinforce", "ROLL's grpo is reinforce after "
                    "the group reward norm")
            for field in ("loss.reward_norm_mean", "loss.reward_norm_std"):
                m.also("adv_estimator", field, "group", "ROLL forces norm_mean_type = norm_std_type = group")
        else:
            m.carry("adv_estimator", "loss.advantage_estimator", "grpo", "(R - mean_g) / (std_g + 1e-6): ROLL's "
                    "group norm then the return, equal with gamma 1 and no token KL")
            m.also("adv_estimator", "loss.estimator_args.group_std", "unbiased", "torch.std")
        for key in ("norm_mean_type", "norm_std_type", "reward_norm", "reward_shift", "reward_scale"):
            m.skip(key, "ROLL's grpo forces the group norm (norm_mean_type = norm_std_type = group)")
    else:
        m.skip("adv_estimator", f"ROLL's {est!r} is not offered here (estimators: docs/algorithm.md)")
    if gamma != 1.0 or m.has("gamma"):
        m.estimator_setting("gamma", "gamma", gamma, "the return-to-go's discount per token")


def _loss(m: Migration, per_token: bool) -> str:
    sampling = m.take("importance_sampling")
    if sampling is None:
        m.note("importance_sampling is not set: ROLL's default is token (GRPO's ratio); here loss.name "
               "defaults to gspo")
        loss = "gspo"
    elif sampling == "seq":
        loss = "gspo_token" if per_token else "gspo"
        how = ("GSPO's sequence ratio; the advantages differ along a response (token KL or gamma < 1): "
               "GSPO-token, Eqs. 13-14 (ROLL averages the per-token terms' clip decisions differently)"
               if per_token else "the sequence ratio exp(mean log-ratio), clipped per sequence (Eqs. 5-7)")
        m.carry("importance_sampling", "loss.name", loss, how)
    else:
        loss = "grpo"
        m.carry("importance_sampling", "loss.name", "grpo", "token ratios (GRPO)")
    mode = m.take("loss_agg_mode")
    if mode is not None:
        if loss.startswith("gspo") and mode != "seq-mean-token-mean":
            m.skip("loss_agg_mode", "GSPO's sequence ratio fixes seq-mean-token-mean (Eq. 5); ROLL's token sums "
                                    "would weigh each sequence's one term by its length")
        else:
            m.carry("loss_agg_mode", "loss.loss_agg_mode", mode, "ROLL's agg_loss mode")
            if mode == "seq-mean-token-sum-norm":
                m.also("loss_agg_mode", "loss.aggregation_args.token_sum_norm",
                       float(m.keys.get("response_length", 0)) or None, "C = response_length")
                m.note("seq-mean-token-sum-norm: ROLL divides by the padded width; here token_sum_norm = "
                       "response_length, and the token sums are averaged over sequences (Dr. GRPO)")
    else:
        m.note("loss_agg_mode is not set: ROLL's default is seq-mean-token-mean, as here")
    return loss


def _clips(m: Migration, loss: str) -> None:
    pg_clip = float(m.take("pg_clip", DEFAULT_PG_CLIP))
    if m.take("use_pg_clip_range", False):
        lo, hi = m.take("pg_clip_low", DEFAULT_PG_CLIP), m.take("pg_clip_high", DEFAULT_PG_CLIP)
        m.carry("pg_clip_low", "loss.eps_low", float(lo), "use_pg_clip_range")
        m.carry("pg_clip_high", "loss.eps_high", float(hi), "use_pg_clip_range")
        m.said("use_pg_clip_range", "the two ranges above")
        m.skip("pg_clip", "use_pg_clip_range takes pg_clip_low / pg_clip_high")
    elif m.has("pg_clip"):
        m.carry("pg_clip", "loss.eps_low", pg_clip, "1 - eps_low")
        m.also("pg_clip", "loss.eps_high", pg_clip, "1 + eps_high")
    else:
        m.skip("pg_clip_low", "use_pg_clip_range is off")
        m.skip("pg_clip_high", "use_pg_clip_range is off")
        m.note(f"pg_clip is not set: ROLL's default {DEFAULT_PG_CLIP} applies there; here loss.eps_low / eps_high "
               f"default to the paper's ({'3e-4 / 4e-4' if loss.startswith('gspo') else '0.2 / 0.27'})")
    if m.take("dual_clip_loss", False):
        m.carry("dual_clip_loss", "loss.dual_clip_c", 1 + 2 * pg_clip, "ROLL's dual clip constant c = 1 + 2 pg_clip")
    elif m.has("dual_clip_loss"):
        m.said("dual_clip_loss", "loss.dual_clip_c: null (off)")
    for key, ours, how in (("advantage_clip", "loss.advantage_clip", "clamp to [-c, c] after whitening"),
                           ("reward_clip", "loss.reward_clip", "clamp to [-c, c] after the reward norm (and "
                                                               "each token's reward with the token KL)")):
        v = m.take(key)
        if v is not None:
            m.carry(key, ours, float(v), how)
        elif m.has(key):
            m.said(key, f"{ours}: null (off)")
    if m.has("whiten_advantages"):
        m.carry("whiten_advantages", "loss.whiten_advantages", bool(m.take("whiten_advantages")),
                "masked whiten over the batch's trained tokens, Bessel's correction, + 1e-8")


def _reward_norm(m: Migration) -> None:
    if "loss.reward_norm_mean" in m.values or (m.keys.get("adv_estimator") == "grpo"):
        return
    mean, std = m.take("norm_mean_type"), m.take("norm_std_type")
    for key, ours, v in (("norm_mean_type", "loss.reward_norm_mean", mean), ("norm_std_type", "loss.reward_norm_std", std)):
        if m.has(key):
            m.carry(key, ours, v, "ROLL's reward_norm")
    norm, shift, scale = m.take("reward_norm"), bool(m.take("reward_shift", False)), bool(m.take("reward_scale", False))
    if norm is None:
        for key in ("reward_norm", "reward_shift", "reward_scale"):
            if m.has(key):
                m.said(key, "no reward normalisation (null): reward_shift / reward_scale act only with a "
                            "reward_norm")
        return
    # ROLL before norm_*_type: shift = subtract the mean only, scale = divide by the std only (running)
    use_mean = not (scale and norm == "running")
    use_std = not shift
    m.carry("reward_norm", "loss.reward_norm_mean", norm if use_mean else None, "subtract the mean")
    m.also("reward_norm", "loss.reward_norm_std", norm if use_std else None, "divide by the std")
    m.said("reward_shift", "the mean only (no std) when true")
    m.said("reward_scale", "the std only (no mean) with the running norm when true")


def _kl(m: Migration, token_kl: bool, loss: str) -> None:
    use_kl_loss = bool(m.take("use_kl_loss", False))
    if use_kl_loss:
        m.carry("kl_loss_coef", "loss.kl_coef", float(m.take("kl_loss_coef", 0.0)), "a KL loss term per the loss's "
                "aggregation")
        m.also("use_kl_loss", "loss.kl_estimator", "low_var_kl", "ROLL's actor uses k3 clamped to [-10, 10]")
        m.named.add("use_kl_loss")
    else:
        m.skip("kl_loss_coef", "use_kl_loss is off")
        if m.has("use_kl_loss"):
            m.said("use_kl_loss", "loss.kl_coef: 0 (off)")
    kind = m.take("kl_penalty", "kl")
    if token_kl:
        coef = float(m.take("init_kl_coef", 0.2))
        m.carry("add_token_level_kl", "loss.kl_in_reward_coef", coef, "beta = init_kl_coef (ROLL's default 0.2 "
                "when unset); each trained token's reward gets -beta KL(pi_old || pi_ref)")
        if kind in KL_KINDS:
            m.carry("kl_penalty", "loss.kl_in_reward_estimator", KL_KINDS[kind], "ROLL's compute_approx_kl kind")
        else:
            m.skip("kl_penalty", f"ROLL's {kind!r} KL is not offered ({KL_ESTIMATORS.names_text()})")
        if m.take("target_kl") is not None:
            m.skip("target_kl", "an adaptive KL coefficient is not offered (a fixed beta)")
    else:
        if m.has("add_token_level_kl"):
            m.said("add_token_level_kl", "loss.kl_in_reward_coef: 0 (off)")
        for key in ("init_kl_coef", "kl_penalty", "target_kl"):
            m.skip(key, "acts only with add_token_level_kl")
    m.skip("kl_horizon", "an adaptive KL coefficient is not offered")
