"""slime's command-line flags (slime/utils/arguments.py; THUDM/slime 2025) in this project's terms,
from a file of flags as its launch scripts hold them (`--flag value` / `--flag`, bash array lines
`NAME=(` ... `)`, `\\` continuations and `#` comments allowed). Formulas: docs/algorithm.md.

slime normalises rewards in the rollout (group mean, and std for grpo / gspo:
_post_process_rewards), gives each token its response's advantage (or REINFORCE++'s returns),
optionally whitens them over the DP group (--normalize-advantages), and takes the per-sample mean
of PPO's clipped terms (or the token mean with --calculate-per-token-loss), with a dual clip at
--eps-clip-c.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gspo_megatron.algorithms.terms import KL_ESTIMATORS
from gspo_megatron.config.parsing import ConfigError
from gspo_megatron.config.peers.migration import Migration, peer_names
from gspo_megatron.config.peers.reading import Found, last_wins, read_text, shell_lines

SWITCHES = {"use-kl-loss", "normalize-advantages", "calculate-per-token-loss", "disable-grpo-std-normalization",
            "disable-rewards-normalization", "apply-chat-template", "rollout-shuffle", "use-dynamic-batch-size",
            "colocate", "use-tis", "balance-data", "use-rollout-logprobs", "use-unbiased-kl", "offload",
            "use-distributed-optimizer", "sequence-parallel", "no-load-optim", "no-load-rng", "use-rollout-entropy",
            "keep-old-actor", "offload-train", "offload-rollout", "use-routing-replay", "use-rollout-routing-replay"}
KL_KINDS = peer_names(KL_ESTIMATORS, "slime")  # slime's kl-loss-type -> ours (its k3 is unclamped, as ours)
NO_COUNTERPART = {
    "actor-num-nodes": "the launch's node shape (launch/)", "actor-num-gpus-per-node": "the launch's node shape",
    "rollout-num-gpus": "SGLang servers: rollout.num_servers / server_urls here",
    "rollout-num-gpus-per-engine": "SGLang's own: rollout.server_extra_args here",
    "colocate": "SGLang servers beside the trainer here", "train-backend": "megatron-core here",
    "rm-type": "the reward is rollout.reward here (a shipped one, an HTTP service or your function: "
               "`gspo-megatron config`)",
    "save": "checkpoint.dir here", "load": "checkpoint.dir here (a run resumes from it)",
    "save-interval": "checkpoint.interval here", "ref-load": "the reference is the policy RL starts from here",
    "eval-interval": "eval.interval here", "eval-prompt-data": "eval.prompts here",
    "use-wandb": "TensorBoard here", "wandb-project": "TensorBoard here", "wandb-group": "TensorBoard here",
    "entropy-coef": "no entropy bonus here", "use-tis": "loss.tis_cap here",
    "balance-data": "rows are balanced over DP by work here (train.dp_balance)",
}


def _flags(text: str, path: Path = Path("flags")) -> tuple[dict[str, object], list[str]]:
    """{flag name: value} (True for a switch) in order of first appearance, and a line for each
    word that is not a flag and each earlier value of a repeated flag (argparse keeps the last).
    Bash arrays may spread over lines: the words are read as one list."""
    words = [(line, w) for line, ws in shell_lines(text, path, "slime") for w in ws
             if w not in ("(", ")") and not w.endswith("=(")]
    found: Found = []
    other: dict[int, list[str]] = {}
    i = 0
    while i < len(words):
        line, w = words[i]
        i += 1
        if not w.startswith("--"):
            other.setdefault(line, []).append(w)
            continue
        name = w[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            found.append((name, value, line))
        elif name in SWITCHES or i >= len(words) or words[i][1].startswith("--"):
            found.append((name, True, line))
        else:
            found.append((name, words[i][1], line))
            i += 1
    flags, repeats = last_wins(found, "slime's argparse")
    lines = [f"not carried  (line {line}) {' '.join(ws)}: not a --flag" for line, ws in other.items()]
    return flags, lines + repeats


def read(path: Path) -> Migration:
    flags, lines = _flags(read_text(path, "slime"), path)
    if not flags:
        raise ConfigError(f"migrate --from slime: {str(path)!r} holds no --flags")
    return Migration("slime", str(path), flags, known=dict(NO_COUNTERPART), reader_lines=lines)


def _typed(m: Migration, key: str, kind: type) -> Any:
    """The flag's value as `kind` (int, float or str); ConfigError naming the flag otherwise."""
    value = m.take(key)
    try:
        return kind(value) if kind is not int else int(str(value))
    except (TypeError, ValueError):
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ConfigError(f"migrate --from slime: --{key} {value!r}: expected {what}") from None


def _float(m: Migration, key: str, default: float) -> float:
    return float(_typed(m, key, float)) if m.has(key) else default


def translate(m: Migration) -> None:
    for key, ours, how, kind in (("n-samples-per-prompt", "rollout.group_size", "responses per prompt", int),
                                 ("rollout-batch-size", "rollout.prompts_per_step", "prompts per rollout", int),
                                 ("rollout-max-response-len", "rollout.max_new_tokens", "the generation budget", int),
                                 ("rollout-max-prompt-len", "rollout.max_prompt_tokens", "longer prompts dropped", int),
                                 ("rollout-temperature", "rollout.temperature", "", float),
                                 ("rollout-top-p", "rollout.top_p", "", float), ("rollout-top-k", "rollout.top_k", "", int),
                                 ("num-rollout", "train.steps", "rollouts = RL steps", int),
                                 ("hf-checkpoint", "model.hf_path", "the initial policy", str),
                                 ("prompt-data", "rollout.prompts", "", str), ("input-key", "rollout.prompt_key", "", str),
                                 ("label-key", "rollout.answer_key", "", str), ("lr", "train.lr", "", float),
                                 ("clip-grad", "train.clip_grad", "", float), ("seed", "train.seed", "", int),
                                 ("weight-decay", "train.weight_decay", "", float),
                                 ("micro-batch-size", "train.micro_batch_size", "", int),
                                 ("tensor-model-parallel-size", "parallel.tensor", "", int),
                                 ("pipeline-model-parallel-size", "parallel.pipeline", "", int),
                                 ("expert-model-parallel-size", "parallel.expert", "", int),
                                 ("context-parallel-size", "parallel.context", "", int)):
        if m.has(key):
            m.carry(key, ours, _typed(m, key, kind), how)
    for key in ("adam-beta1", "adam-beta2"):
        if m.has(key):
            m.carry(key, f"train.{key.replace('-', '_')}", _typed(m, key, float), "Adam's beta")
    m.said("apply-chat-template", "prompts go through the tokenizer's chat template here, always")
    if m.keys.get("optimizer") in ("adam", "sgd"):
        m.carry("optimizer", "train.optimizer", m.take("optimizer"), "")
    if m.keys.get("lr-decay-style") in ("constant", "linear", "cosine"):
        m.carry("lr-decay-style", "train.lr_decay_style", m.take("lr-decay-style"), "")
    if m.has("rollout-shuffle"):
        m.carry("rollout-shuffle", "rollout.shuffle_prompts", True, "")
    if m.take("use-dynamic-batch-size", False):
        m.said("use-dynamic-batch-size", "token-budget micro-batches")
        if m.has("max-tokens-per-gpu"):
            m.carry("max-tokens-per-gpu", "train.max_tokens_per_micro_batch", _typed(m, "max-tokens-per-gpu", int), "")
    else:
        m.skip("max-tokens-per-gpu", "acts only with --use-dynamic-batch-size")
    _mini_batches(m)
    est = str(m.take("advantage-estimator", "grpo"))
    loss = _estimator(m, est)
    _loss(m, loss)
    _kl(m, est)


def _mini_batches(m: Migration) -> None:
    if m.has("num-steps-per-rollout"):
        m.carry("num-steps-per-rollout", "train.mini_batches", _typed(m, "num-steps-per-rollout", int), "")
        m.skip("global-batch-size", "--num-steps-per-rollout sets the updates per rollout")
    elif m.has("global-batch-size"):
        total = m.values.get("rollout.prompts_per_step", 0) * m.values.get("rollout.group_size", 1)
        gbs = _typed(m, "global-batch-size", int)
        if total and gbs and total % gbs == 0:
            m.carry("global-batch-size", "train.mini_batches", total // gbs,
                    "rollout-batch-size x n-samples-per-prompt / global-batch-size")
        else:
            m.skip("global-batch-size", "not a divisor of the rollout's responses: set train.mini_batches")


def _estimator(m: Migration, est: str) -> str:
    std = not m.take("disable-grpo-std-normalization", False)
    norm = not m.take("disable-rewards-normalization", False)
    group = {"grpo": "grpo", "gspo": "gspo", "cispo": None, "reinforce_plus_plus": "grpo",
             "reinforce_plus_plus_baseline": "grpo", "ppo": None}.get(est)
    if group is None:
        m.skip("advantage-estimator", f"slime's {est!r} is not offered here (a critic or CISPO's loss)")
        return "gspo"
    if est in ("grpo", "gspo"):
        ours = ("grpo" if std else "dr_grpo") if norm else "reinforce"
        how = {"grpo": "(R - mean_g) / (std_g + 1e-6), on every token", "dr_grpo": "R - mean_g (no std)",
               "reinforce": "the raw reward (--disable-rewards-normalization)"}[ours]
        m.carry("advantage-estimator", "loss.advantage_estimator", ours, how)
        if ours == "grpo":
            m.also("advantage-estimator", "loss.estimator_args.group_std", "unbiased", "torch.std")
        m.also("advantage-estimator", "loss.name", group, "GSPO's sequence ratio" if group == "gspo"
               else "token ratios")
    else:
        # slime subtracts rpp_baseline's group mean in its reward post-processing, which
        # --disable-rewards-normalization turns off: the raw reward on every token, whitened, is
        # our reinforce_plus_plus's return (gamma 1)
        ours = "reinforce_plus_plus" if est == "reinforce_plus_plus_baseline" and not norm else est
        m.carry("advantage-estimator", "loss.advantage_estimator", ours, "slime's estimator, whitened" + (
            " (--disable-rewards-normalization: no group mean, the raw reward on every token)" if ours != est else ""))
        m.also("advantage-estimator", "loss.name", "grpo", "slime's token-ratio loss")
        if not m.keys.get("normalize-advantages"):
            m.note(f"slime refuses {est} without --normalize-advantages (arguments.py); the advantages are "
                   "whitened here")
    m.said("disable-grpo-std-normalization", "the estimator above")
    m.said("disable-rewards-normalization", "the estimator above")
    if m.take("normalize-advantages", False):
        m.carry("normalize-advantages", "loss.whiten_advantages", True, "over the batch's trained tokens, every DP rank")
    if m.has("gamma"):
        m.estimator_setting("gamma", "gamma", _float(m, "gamma", 1.0), "the return-to-go's discount")
    return group


def _loss(m: Migration, loss: str) -> None:
    lo = _float(m, "eps-clip", 0.2)
    hi = _float(m, "eps-clip-high", lo)
    if m.has("eps-clip"):
        m.carry("eps-clip", "loss.eps_low", float(lo), "1 - eps")
    if m.has("eps-clip-high"):
        m.carry("eps-clip-high", "loss.eps_high", float(hi), "1 + eps")
    elif m.has("eps-clip"):
        m.also("eps-clip", "loss.eps_high", float(hi), "1 + eps (--eps-clip when --eps-clip-high is not given)")
    else:
        m.note("--eps-clip is not set: slime's default 0.2 applies there; here the paper's for the loss")
    if m.has("eps-clip-c"):
        m.carry("eps-clip-c", "loss.dual_clip_c", _float(m, "eps-clip-c", 0.0), "dual clip for A < 0")
    if m.take("calculate-per-token-loss", False):
        m.carry("calculate-per-token-loss", "loss.loss_agg_mode", "token-mean", "the mean over the batch's "
                "trained tokens" + (", each with its sequence's ratio (a sequence weighs by its length)"
                                    if loss == "gspo" else ""))
    coef = _float(m, "entropy-coef", 0.0)
    if m.has("entropy-coef"):
        if coef:
            m.skip("entropy-coef", "no entropy bonus here")
        else:
            m.said("entropy-coef", "no entropy bonus, as here")


def _kl(m: Migration, est: str) -> None:
    kind = str(m.take("kl-loss-type", "k1"))
    if kind not in KL_KINDS:
        raise ConfigError(f"migrate --from slime: --kl-loss-type {kind!r}: expected one of {', '.join(KL_KINDS)}")
    if m.take("use-kl-loss", False):
        m.carry("kl-loss-coef", "loss.kl_coef", _typed(m, "kl-loss-coef", float) if m.has("kl-loss-coef") else 0.0,
                "a KL loss term, per-sample mean")
        m.said("use-kl-loss", "loss.kl_coef above")
        m.carry("kl-loss-type", "loss.kl_estimator", KL_KINDS[kind], "slime's compute_approx_kl kind")
    else:
        m.skip("kl-loss-coef", "acts only with --use-kl-loss")
    coef = _typed(m, "kl-coef", float) if m.has("kl-coef") else 0.0
    if coef and est == "reinforce_plus_plus":
        m.carry("kl-coef", "loss.kl_in_reward_coef", float(coef), "each token's reward gets -kl_coef KL(pi_old || "
                "pi_ref), then the returns")
        if m.has("kl-loss-type") and "kl-loss-type" not in m.named:
            m.carry("kl-loss-type", "loss.kl_in_reward_estimator", KL_KINDS[kind], "the KL in the reward's kind")
        else:
            m.also("kl-coef", "loss.kl_in_reward_estimator", KL_KINDS[kind], "--kl-loss-type (k1 unless set)")
    elif coef:
        m.skip("kl-coef", f"slime's {est} advantages " + ("subtract each token's own KL (not the sum "
               "verl's and this project's estimators take)" if est == "reinforce_plus_plus_baseline"
               else "ignore --kl-coef (get_grpo_returns)"))
    elif m.has("kl-coef"):
        m.said("kl-coef", "loss.kl_in_reward_coef: 0 (off)")
    if m.has("kl-loss-type") and "kl-loss-type" not in m.named:
        m.skip("kl-loss-type", "acts only with --use-kl-loss or --kl-coef")
