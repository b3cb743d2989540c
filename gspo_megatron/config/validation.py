"""Range and cross-field checks of a run config (loading.py calls them): every rule that involves a
value's range or two sections at once. Each failure is a ConfigError naming the field, the value
and what was expected. Types are checked while parsing (parsing.py), and a section's own
rules in its __post_init__.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from gspo_megatron.config.parsing import ConfigError
from gspo_megatron.config.schema import RunConfig


def validate(cfg: RunConfig, given: Mapping[str, Any] | None = None) -> None:
    """ConfigError at the first rule `cfg` breaks. given: the mapping the config was built from
    (sections of fields the user wrote), for the rules about a field written where it does nothing."""
    def need(cond: bool, field: str, value: Any, expected: str) -> None:
        if not cond:
            raise ConfigError(f"{field}={value!r}: expected {expected}")
    m, r, t, c = cfg.model, cfg.rollout, cfg.train, cfg.checkpoint
    need(bool(m.hf_path), "model.hf_path", m.hf_path, "a Hugging Face model directory")
    need(bool(r.prompts), "rollout.prompts", r.prompts,
         "a prompt set: a path or a list of paths, each of a format of rollout.prompt_format's choices")
    need(r.max_prompt_tokens is None or r.max_prompt_tokens >= 1, "rollout.max_prompt_tokens",
         r.max_prompt_tokens, ">= 1 or null")
    for name in ("server_health_interval_s", "server_health_timeout_s", "server_wait_s", "abort_timeout_s"):
        need(getattr(r, name) > 0, f"rollout.{name}", getattr(r, name), "> 0 (seconds)")
    for name in ("server_max_restarts", "server_max_restarts_per_run"):
        need(getattr(r, name) >= 0, f"rollout.{name}", getattr(r, name), ">= 0")
    e = cfg.eval
    need(e.interval >= 0, "eval.interval", e.interval, ">= 0 (0 = never)")
    need(not e.interval or bool(e.prompts), "eval.prompts", e.prompts,
         "a prompt set when eval.interval > 0")
    need(e.samples_per_prompt >= 1, "eval.samples_per_prompt", e.samples_per_prompt, ">= 1")
    need(e.temperature >= 0, "eval.temperature", e.temperature, ">= 0 (0 = greedy)")
    need(e.samples_per_prompt == 1 or e.temperature > 0, "eval.samples_per_prompt", e.samples_per_prompt,
         "1 with eval.temperature=0: greedy decoding gives n identical responses (pass@k would equal "
         "accuracy); set eval.temperature > 0 (e.g. 0.6) to sample n")
    need(0 < e.top_p <= 1, "eval.top_p", e.top_p, "in (0, 1]")
    need(e.max_new_tokens is None or e.max_new_tokens >= 1, "eval.max_new_tokens", e.max_new_tokens,
         ">= 1 or null")
    need(e.max_prompts is None or e.max_prompts >= 1, "eval.max_prompts", e.max_prompts, ">= 1 or null")
    for name in ("tensor", "pipeline", "expert", "context"):
        v = getattr(cfg.parallel, name)
        need(v >= 1, f"parallel.{name}", v, ">= 1")
    # A group-relative estimator (GSPO Eq. 6, RLOO, ...) or reward norm gives a group of one
    # advantage exactly 0 everywhere: the run would learn nothing while looking healthy.
    d = cfg.distill
    per_token = bool(d.teacher) and d.coef > 0  # distillation's per-token term needs no group
    need(r.group_size >= 2 or not cfg.loss.group_relative or (per_token and r.group_size >= 1),
         "rollout.group_size", r.group_size, f">= 2: {_group_relative_reason(cfg)}")
    _advantage_rules(cfg, need)
    _lora_rules(cfg, need)
    _knobs_that_do_nothing(cfg, given or {})
    if d.teacher:
        need(cfg.loss.name == "gspo_token", "loss.name", cfg.loss.name,
             "gspo_token with distill.teacher (each token gets its own advantage; GSPO's sequence "
             "ratio and clipping stay)")
        need(d.coef >= 0 and d.reward_coef >= 0 and (d.coef > 0 or d.reward_coef > 0), "distill.coef",
             d.coef, f">= 0, with distill.reward_coef={d.reward_coef} >= 0, not both 0 (every advantage "
             "would be 0)")
        need(d.teacher_num_servers >= 1, "distill.teacher_num_servers", d.teacher_num_servers, ">= 1")
        need(d.max_in_flight >= 1, "distill.max_in_flight", d.max_in_flight, ">= 1")
        for url in d.teacher_server_urls:
            need(url.startswith(("http://", "https://")), "distill.teacher_server_urls", url,
                 "URLs like http://host:port")
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, ">= 1")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, ">= 1")
    need(r.temperature > 0, "rollout.temperature", r.temperature,
         "> 0 (log-probs are computed at this temperature; greedy has none)")
    need(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "in (0, 1]")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", r.top_k, "-1 (off) or >= 1")
    need(r.num_servers >= 1, "rollout.num_servers", r.num_servers, ">= 1")
    need(0 <= r.max_reward_error_fraction <= 1, "rollout.max_reward_error_fraction",
         r.max_reward_error_fraction, "in [0, 1]")
    need(r.reward_workers >= 1, "rollout.reward_workers", r.reward_workers, ">= 1")
    need(r.reward_timeout_s > 0, "rollout.reward_timeout_s", r.reward_timeout_s, "> 0")
    from rollout.rewards.registry import reward_settings
    eval_settings = reward_settings(cfg.eval.reward or r.reward, cfg.eval_reward_args(),
                                    "eval.reward_args" if cfg.eval.reward_args is not None else "rollout.reward_args")
    for settings, where in ((r.reward_settings, "rollout.reward_args"), (eval_settings, "eval.reward_args")):
        misfit = getattr(settings, "misfit", None)  # the reward's own bound against the call's
        if misfit is not None and misfit(r.reward_timeout_s, where):
            raise ConfigError(misfit(r.reward_timeout_s, where))
    for url in r.server_urls:
        need(url.startswith(("http://", "https://")), "rollout.server_urls", url,
             "URLs like http://host:port")
    need(not r.mask_stale_tokens or r.partial_rollouts, "rollout.mask_stale_tokens",
         r.mask_stale_tokens, "false unless rollout.partial_rollouts is true")
    need(r.max_turns is None or r.max_turns >= 1, "rollout.max_turns", r.max_turns, ">= 1 or null")
    need(r.turn_credit == "episode" or (bool(r.environment) and cfg.loss.name == "gspo_token"),
         "rollout.turn_credit", r.turn_credit,
         "'episode' unless rollout.environment is set and loss.name is gspo_token (per-token "
         "advantages; gspo uses the episode return)")
    need(0 < r.turn_discount <= 1, "rollout.turn_discount", r.turn_discount, "in (0, 1]")
    need(t.steps >= 0, "train.steps", t.steps, ">= 0")
    need(t.mini_batches >= 1, "train.mini_batches", t.mini_batches, ">= 1")
    batch = r.group_size * r.prompts_per_step
    need(batch % t.mini_batches == 0, "train.mini_batches", t.mini_batches,
         f"a divisor of the rollout batch ({r.prompts_per_step} prompts x {r.group_size} = "
         f"{batch} responses)")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, ">= 1")
    need(t.lr >= 0, "train.lr", t.lr, ">= 0")
    need(t.clip_grad >= 0, "train.clip_grad", t.clip_grad, ">= 0")
    need(t.warm_start_steps >= 0, "train.warm_start_steps", t.warm_start_steps, ">= 0")
    need(t.warm_start_batch_size >= 1, "train.warm_start_batch_size", t.warm_start_batch_size,
         ">= 1")
    need(c.interval >= 1, "checkpoint.interval", c.interval, ">= 1")
    need(c.keep >= 0, "checkpoint.keep", c.keep, ">= 0")
    need(cfg.sync.bucket_mb >= 1, "sync.bucket_mb", cfg.sync.bucket_mb, ">= 1")
    for cap in ("tis_cap", "seq_is_cap", "mis_cap"):
        v = getattr(cfg.loss, cap)
        need(v is None or t.old_log_probs == "recompute", f"loss.{cap}", v,
             "null with train.old_log_probs=engine (pi_old is then the engine's: no mismatch to correct)")
    need(not cfg.moe.drift or t.old_log_probs == "recompute", "moe.drift", cfg.moe.drift,
         "false or null with train.old_log_probs=engine (pi_old's routing is recorded in the "
         "recompute pass)")
    need(t.max_staleness >= 0, "train.max_staleness", t.max_staleness, ">= 0")
    if t.max_staleness > 0:
        need(r.max_buffered_groups is None or r.max_buffered_groups >= r.prompts_per_step,
             "rollout.max_buffered_groups", r.max_buffered_groups,
             f">= rollout.prompts_per_step ({r.prompts_per_step}) or null")
        need(r.max_buffered_tokens is None or r.max_buffered_tokens >= 1,
             "rollout.max_buffered_tokens", r.max_buffered_tokens, ">= 1 or null")
        need(not cfg.moe.drift, "moe.drift", cfg.moe.drift,
             "false or null with train.max_staleness > 0 (pi_old spans several weight versions)")
        need(not r.mask_stale_tokens, "rollout.mask_stale_tokens", r.mask_stale_tokens,
             "false with train.max_staleness > 0 (stale tokens train, with their own pi_old)")
    need(not (cfg.moe.replay and cfg.moe.engine_routing is False), "moe.engine_routing",
         cfg.moe.engine_routing, "true or null with moe.replay=true (replay needs the engine's routing)")


def _group_relative_reason(cfg: RunConfig) -> str:
    """Which field makes the advantages relative to the prompt's group, and what a group of one
    then gives."""
    loss = cfg.loss
    if loss.estimator.kind == "group":
        return (f"loss.advantage_estimator={loss.advantage_estimator} is relative to the prompt's group "
                "(reward minus the mean of the group, GSPO Eq. 6), so a group of one has advantage 0 "
                "everywhere and the run would learn nothing")
    if loss.reward_norm_std == "group":
        return ("loss.reward_norm_std=group divides each reward by the std of its prompt's group, which a "
                "group of one does not have (NaN advantages); set it to batch, running or null")
    return ("loss.reward_norm_mean=group subtracts the mean of the prompt's group from each reward, so a "
            "group of one has reward 0 everywhere and the run would learn nothing; set it to batch, running "
            "or null")


def _advantage_rules(cfg: RunConfig, need: Callable[[bool, str, Any, str], None]) -> None:
    """The loss section's advantage fields against the loss, the rollout and distillation."""
    loss, r = cfg.loss, cfg.rollout
    credit = r.turn_credit if r.environment else "episode"
    if r.group_size * r.prompts_per_step == 1:  # a batch statistic of one response
        one = "one response per rollout batch (rollout.prompts_per_step=1 x rollout.group_size=1)"
        need(loss.reward_norm_std != "batch", "loss.reward_norm_std", loss.reward_norm_std,
             f"null or running with {one}: the std of a single reward is undefined (NaN advantages)")
        need(loss.reward_norm_mean != "batch", "loss.reward_norm_mean", loss.reward_norm_mean,
             f"null or running with {one}: the batch mean is that reward itself, so every advantage would "
             "be 0 and the run would learn nothing")
        if not loss.per_token(credit):
            field = "loss.whiten_advantages" if loss.whiten_advantages else "loss.advantage_estimator"
            need(not (loss.whiten_advantages or loss.estimator.whitens), field, getattr(cfg.loss, field[5:]),
                 f"{'false' if loss.whiten_advantages else 'an estimator that does not whiten'} with {one}: "
                 "whitening one advantage over the batch leaves exactly 0, and the run would learn nothing")
    need(not loss.per_token(credit) or loss.spec.takes_token_advantages, "loss.name", loss.name,
         f"a loss that takes one advantage per token (gspo_token, grpo): {loss.describe().split(' | ')[1]}"
         f"{' with rollout.turn_credit=return_to_go' if credit == 'return_to_go' else ''} gives each "
         f"token its own, and {loss.name}'s ratio takes one per sequence")
    if credit == "return_to_go":
        shaped = [f for f in ("reward_norm_mean", "reward_norm_std", "reward_clip") if getattr(loss, f) is not None]
        need(not shaped, f"loss.{shaped[0] if shaped else ''}", getattr(loss, shaped[0]) if shaped else None,
             "null with rollout.turn_credit=return_to_go (reward shaping acts on one reward per response)")
        need(loss.estimator.kind == "group" or r.turn_discount == 1, "rollout.turn_discount", r.turn_discount,
             f"1 with loss.advantage_estimator={loss.advantage_estimator} (it discounts per token: loss.gamma)")
    if loss.kl_in_reward:
        need(credit == "episode", "loss.kl_in_reward_coef", loss.kl_in_reward_coef,
             "0 with rollout.turn_credit=return_to_go (the KL in the reward takes one reward per response)")
        need(not cfg.distill.teacher, "loss.kl_in_reward_coef", loss.kl_in_reward_coef,
             "0 with distill.teacher (distillation's per-token term is the advantage's KL already)")


def _lora_rules(cfg: RunConfig, need: Callable[[bool, str, Any, str], None]) -> None:
    """The lora section against the layout and the weight sync."""
    lora = cfg.lora
    if not lora.enabled:
        for name in ("init_peft", "export_peft"):
            need(getattr(lora, name) is None, f"lora.{name}", getattr(lora, name), "null with lora.rank=0")
        return
    etp = cfg.parallel.etp
    need(not lora.expert_targets() or etp == 1, "parallel.expert_tensor", cfg.parallel.expert_tensor,
         f"1 with lora.experts={lora.experts} (null means parallel.tensor={cfg.parallel.tensor}): routed-expert "
         "adapters need whole experts on a rank; set parallel.expert_tensor: 1, or lora.experts: none")
    need(cfg.sync.delta is not True, "sync.delta", cfg.sync.delta,
         f"null or false with lora.rank={lora.rank}: a LoRA run sends its adapters whole (every element "
         "of an adapter moves every step) and never the base")

def _knobs_that_do_nothing(cfg: RunConfig, given: Mapping[str, Any]) -> None:
    """A field the user wrote that the rest of the config makes inert is named, not ignored."""
    section = given.get("loss")
    written: Mapping[str, Any] = section if isinstance(section, Mapping) else {}
    loss = cfg.loss
    for field, coef, on in (("kl_estimator", "kl_coef", loss.kl_coef > 0),
                            ("kl_in_reward_estimator", "kl_in_reward_coef", loss.kl_in_reward)):
        if field in written and not on:
            raise ConfigError(f"loss.{field}={getattr(loss, field)!r}: acts only with loss.{coef} > 0, which is "
                              f"{getattr(loss, coef)!r} (no KL term): set loss.{coef}, or leave {field} out")
    if written.get("whiten_advantages") is False and loss.estimator.whitens:
        raise ConfigError(f"loss.whiten_advantages=false: loss.advantage_estimator={loss.advantage_estimator} "
                          "whitens its advantages over the batch whatever this says; leave it out, or choose an "
                          "estimator that does not whiten (docs/algorithm.md, Advantage estimators)")
