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
from gspo_megatron.config.parsing import ConfigError
from gspo_megatron.config.peers.migration import (Migration, carry_lora, flatten, peer_names,
                                                  resolve_interpolations)
from gspo_megatron.config.peers.reading import read_text, yaml_mapping

KL_KINDS = peer_names(KL_ESTIMATORS, "roll")  # ROLL's kl_penalty kinds -> ours (its k3 is clamped at 10)
DEFAULT_PG_CLIP = 0.2
DEFAULT_PROMPT_LENGTH = 1024  # roll/configs/base_config.py BaseConfig.prompt_length
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
    data = yaml_mapping(read_text(path, "roll"), path, "roll", required=True)
    return Migration("roll", str(path), resolve_interpolations(flatten(data or {})), known=dict(NO_COUNTERPART))


def translate(m: Migration) -> None:
    _sizes(m)
    _workers(m)
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
    _budget(m)
    for key, same in (("actor_infer.generating_args.max_new_tokens", "response_length"),
                      ("actor_infer.generating_args.num_return_sequences", "num_return_sequences_in_group")):
        if m.has(key):
            if (m.has(same) and m.take(key) == m.keys[same]) or (
                    same == "response_length" and m.keys.get(key) == m.values.get("rollout.max_new_tokens")):
                m.said(key, "as rollout.max_new_tokens (the same value)" if same == "response_length"
                       else f"as {same} (the same value)")
            else:
                m.skip(key, f"differs from {same}: set the rollout field from one of them")
    epochs = m.take("ppo_epochs", 1)
    if m.has("ppo_epochs"):
        if epochs == 1:
            m.said("ppo_epochs", "one pass over each rollout batch (train.mini_batches updates), as here")
        else:
            m.skip("ppo_epochs", "several passes over one rollout batch are not offered (one pass, "
                                 "train.mini_batches updates)")


def sequence_length(m: Migration) -> int | None:
    """ROLL's padded sequence width: sequence_length, else prompt_length (1024 unless set) +
    response_length (roll/configs/base_config.py BaseConfig.__post_init__)."""
    for key in ("sequence_length", "response_length", "prompt_length"):
        if m.has(key) and not (isinstance(m.keys[key], int) and not isinstance(m.keys[key], bool)):
            raise ConfigError(f"migrate --from roll: {key}={m.keys[key]!r}: expected an integer")
    if m.has("sequence_length"):
        return int(m.keys["sequence_length"])
    if m.has("response_length"):
        return int(m.keys.get("prompt_length", DEFAULT_PROMPT_LENGTH)) + int(m.keys["response_length"])
    return None


def _budget(m: Migration) -> None:
    """rollout.max_new_tokens: ROLL generates sequence_length - prompt_length new tokens (its
    RLVRConfig rewrites actor_infer's max_new_tokens so); sequence_length, when given, wins over
    response_length (BaseConfig sets response_length to None)."""
    width = sequence_length(m)
    if width is None:
        return
    budget = width - int(m.keys.get("prompt_length", DEFAULT_PROMPT_LENGTH))
    if m.has("sequence_length"):
        m.carry("sequence_length", "rollout.max_new_tokens", budget, "sequence_length - prompt_length "
                f"({m.keys.get('prompt_length', DEFAULT_PROMPT_LENGTH)}), the new tokens ROLL generates")
        m.skip("response_length", "sequence_length is given, and ROLL then ignores response_length")
    else:
        m.carry("response_length", "rollout.max_new_tokens", budget, "the generation budget")


WORKER_KEYS = (  # actor_train.* -> ours
    ("training_args.warmup_steps", "train.lr_warmup_steps", "linear warm-up steps of the learning rate"),
    ("training_args.max_grad_norm", "train.clip_grad", "gradient norm clip"),
    ("data_args.file_name", "rollout.prompts", "the training prompts (jsonl / parquet; relative to the working "
                                               "directory here)"),
    ("data_args.prompt", "rollout.prompt_key", "the prompt column"),
    ("data_args.messages", "rollout.prompt_key", "the column of chat messages (a list of {role, content})"),
    ("data_args.response", "rollout.answer_key", "the label column the reward compares with"),
    ("strategy_args.strategy_config.tensor_model_parallel_size", "parallel.tensor", ""),
    ("strategy_args.strategy_config.pipeline_model_parallel_size", "parallel.pipeline", ""),
    ("strategy_args.strategy_config.virtual_pipeline_model_parallel_size", "parallel.virtual_pipeline", ""),
    ("strategy_args.strategy_config.expert_model_parallel_size", "parallel.expert", ""),
    ("strategy_args.strategy_config.expert_tensor_parallel_size", "parallel.expert_tensor", ""),
    ("strategy_args.strategy_config.context_parallel_size", "parallel.context", ""),
    ("strategy_args.strategy_config.use_distributed_optimizer", "train.use_distributed_optimizer", ""),
)
EVAL_KEYS = (("validation.data_args.file_name", "eval.prompts", "the held-out prompts"),
             ("validation.generating_args.temperature", "eval.temperature", ""),
             ("validation.generating_args.top_p", "eval.top_p", ""),
             ("validation.generating_args.num_return_sequences", "eval.samples_per_prompt", ""))


def _workers(m: Migration) -> None:
    """The worker blocks' keys that are run settings here: actor_train's optimizer, data and layout,
    validation's prompt set and sampling."""
    for key, ours, how in WORKER_KEYS:
        key = f"actor_train.{key}"
        if m.has(key) and m.keys[key] is not None and ours not in m.values:
            m.carry(key, ours, m.take(key), how)
    if m.has("actor_train.data_args.file_name") and not m.has("actor_train.data_args.prompt") and not m.has(
            "actor_train.data_args.messages"):
        m.note("actor_train.data_args names no prompt column: rollout.prompt_key stays 'prompt' here")
    if not m.has("validation.data_args.file_name"):
        return
    for key, ours, how in EVAL_KEYS:
        if m.has(key) and m.keys[key] is not None:
            m.carry(key, ours, m.take(key), how)
    if m.has("eval_steps"):
        m.carry("eval_steps", "eval.interval", m.take("eval_steps"), "held-out eval every N steps")
    budget = m.keys.get("validation.generating_args.max_new_tokens")
    if budget is not None and budget != m.values.get("rollout.max_new_tokens"):
        m.carry("validation.generating_args.max_new_tokens", "eval.max_new_tokens", budget, "")


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
        # ROLL's grpo is reinforce after the group norm of the rewards (reward_postprocess): with a
        # token KL, a discount or a reward clip (applied to the normalised rewards) our grpo
        # estimator, which normalises after the reward clip, would not be it
        if token_kl or gamma < 1 or m.keys.get("reward_clip") is not None:
            m.carry("adv_estimator", "loss.advantage_estimator", "reinforce", "ROLL's grpo is reinforce after "
                    "the group reward norm (and the reward clip after that norm)")
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
        loss = "gspo"
        how = ("GSPO's sequence ratio on each token; the advantages differ along a response (token KL or gamma "
               "< 1), and gspo takes them as ROLL does, differentiating through s_i (gspo_token would give "
               "each token its own, the paper's Eqs. 13-14)" if per_token
               else "the sequence ratio exp(mean log-ratio), clipped per sequence (Eqs. 5-7)")
        m.carry("importance_sampling", "loss.name", loss, how)
    else:
        loss = "grpo"
        m.carry("importance_sampling", "loss.name", "grpo", "token ratios (GRPO)")
    mode = m.take("loss_agg_mode")
    if mode is not None:
        m.carry("loss_agg_mode", "loss.loss_agg_mode", mode, "ROLL's agg_loss mode" + (
            ": the sequence ratio on each trained token, the tokens' terms aggregated so (a sequence weighs by "
            "its length with token sums)" if loss == "gspo" and mode != "seq-mean-token-mean" else ""))
        if mode == "seq-mean-token-sum-norm":
            width = sequence_length(m)
            if width is None:
                raise ConfigError("migrate --from roll: loss_agg_mode=seq-mean-token-sum-norm divides by ROLL's padded "
                                  "width, and the file gives neither sequence_length nor response_length")
            m.also("loss_agg_mode", "loss.aggregation_args.token_sum_norm", float(width - 1),
                   "C = sequence_length - 1, the padded width ROLL divides by")
            m.note("seq-mean-token-sum-norm: ROLL sums the token sums over C with no mean over the sequences: "
                   "its gradient is this one's times the sequences of an optimizer step (docs/algorithm.md)")
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
        m.said("use_kl_loss", "loss.kl_coef above (the KL loss term on)")
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
