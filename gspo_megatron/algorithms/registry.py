"""The one table of policy losses: names, the paper's clip ranges, advantage shapes, metric keys.

    spec = LOSSES["gspo"]            # LossSpec
    loss, metrics = spec.function()(log_probs, old_log_probs, advantages, loss_mask, ...)
    settings = LossSettings(name="grpo")   # clip_range() -> the paper's (0.2, 0.27)

The run config (gspo_megatron/config/schema.py), the actor (actor/steps.py) and the package's exports
read this table; nothing else writes a loss name, a default clip range or a metric key. The module
imports no torch (the config is validated before torch is imported), so the functions are named
here and imported on first use.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

# The paper's clip ranges (arXiv 2507.18071 §5.1): GSPO 3e-4 / 4e-4; the GRPO baseline 0.2 / 0.27.
GSPO_CLIP = (3e-4, 4e-4)
GRPO_CLIP = (0.2, 0.27)

# Schulman's estimators of KL(pi || pi_ref) per token (kl.py): k1, k2, k3; low_var_kl is k3 clamped to
# [-10, 10] (verl's k3 and low_var_kl, slime's low_var_kl); abs is |k1| (verl, ROLL).
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
KLEstimatorName = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]

# How a loss's per-token (or per-row) terms become one number, verl's and ROLL's agg_loss modes
# (rows.py, docs/algorithm.md "Loss aggregation"); N = rows with a trained token in the global batch,
# T = trained tokens of the global batch, C = loss.token_sum_norm:
#   seq-mean-token-mean      (1/N) sum_i (1/L_i) sum_t l_it
#   seq-mean-token-sum       (1/N) sum_i sum_t l_it
#   seq-mean-token-sum-norm  (1/N) sum_i sum_t l_it / C          (Dr. GRPO)
#   token-mean               (1/T) sum_i sum_t l_it
AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean")
AggregationName = Literal[AGGREGATIONS]  # type: ignore[valid-type]
SEQUENCE_MEAN = AGGREGATIONS[0]

# How each loss metric combines over micro-batches and ranks (loss_metrics.py explains the keys).
METRIC_REDUCTIONS: dict[str, str] = {
    "num_sequences": "sum",
    "num_tokens": "sum",
    "clipped_sequences": "sum",
    "clipped_tokens": "sum",
    "seq_ratio_sum": "sum",
    "kl_sum": "sum",
    "seq_ratio_min": "min",
    "seq_ratio_max": "max",
}
_RATIO_KEYS = ("num_sequences", "num_tokens", "clipped_tokens", "seq_ratio_sum", "seq_ratio_min",
               "seq_ratio_max")


@dataclass(frozen=True)
class LossSpec:
    """One policy loss: what the config, the actor and the metrics need to know about it."""

    name: str
    function_path: str | None
    """`module:function` under gspo_megatron.algorithms; None for "ce" (the actor computes it)."""
    clip: tuple[float, float] | None
    """The paper's (eps_low, eps_high) for this loss; None: the loss does not clip (its function
    then takes no eps_low / eps_high)."""
    advantages: Literal["sequence", "token"]
    """Shape the function takes: one advantage per sequence `[b]`, or per token `[b, s]` (the
    actor broadcasts sequence advantages along the row for a "token" loss)."""
    metric_keys: tuple[str, ...]
    """Keys of METRIC_REDUCTIONS its metrics carry (kl_sum is added when a KL penalty is on)."""
    description: str
    rl: bool = True
    """A policy-gradient loss the run config may select (False: "ce", for warm starts/benchmarks)."""
    also_token_advantages: bool = False
    """A "sequence" row whose function takes per-token advantages `[b, s]` as well (grpo): the
    per-token estimators and per-turn credit may feed it."""
    aggregations: tuple[str, ...] = (SEQUENCE_MEAN,)
    """The AGGREGATIONS its function computes (`loss_agg_mode`); a row that takes only the default
    is called without the argument. GSPO's sequence ratio fixes its own (Eq. 5: a mean over
    sequences of one term each), so gspo and gspo_token list only seq-mean-token-mean."""

    @property
    def takes_token_advantages(self) -> bool:
        return self.advantages == "token" or self.also_token_advantages

    def function(self) -> Callable | None:
        if self.function_path is None:
            return None
        module, name = self.function_path.split(":")
        return getattr(importlib.import_module(f"gspo_megatron.algorithms.{module}"), name)

    def reported_keys(self, with_kl: bool) -> dict[str, str]:
        """{metric key: reduction op} this loss reports per micro-batch."""
        keys = list(self.metric_keys) + (["kl_sum"] if with_kl else [])
        return {k: METRIC_REDUCTIONS[k] for k in keys}


LOSSES: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("gspo", "gspo:gspo_loss", GSPO_CLIP, "sequence",
             _RATIO_KEYS + ("clipped_sequences",),
             "sequence-level ratio s_i = exp(mean log-ratio), clipped per sequence (Eqs. 5-7)"),
    LossSpec("gspo_token", "gspo:gspo_token_loss", GSPO_CLIP, "token", _RATIO_KEYS,
             "GSPO-token: s_i per token with per-token advantages (Eqs. 13-14)"),
    LossSpec("grpo", "grpo:grpo_loss", GRPO_CLIP, "sequence", _RATIO_KEYS,
             "GRPO baseline: token-level ratios (Eqs. 2-3)", also_token_advantages=True,
             aggregations=AGGREGATIONS),
    LossSpec("ce", None, None, "sequence", ("num_sequences", "num_tokens"),
             "next-token cross-entropy over trained tokens (warm start, cost comparisons)", rl=False),
)}
RL_LOSSES = tuple(n for n, s in LOSSES.items() if s.rl)
# A Literal of the names, so the config parser names them in its errors.
RLLossName = Literal[RL_LOSSES]  # type: ignore[valid-type]


@dataclass
class LossSettings:
    """Which loss the train step applies on the last pipeline stage, and its parameters."""

    name: str = "gspo"
    """A name of the LOSSES table: gspo (sequence ratio, Eqs. 5-7), gspo_token (Eqs. 13-14), grpo
    (token ratio), ..., or ce (plain next-token cross-entropy over trained tokens)."""
    eps_low: float | None = None
    """Lower clip range; null = the paper's value for the loss (gspo 3e-4, grpo 0.2)."""
    eps_high: float | None = None
    """Upper clip range; null = the paper's value for the loss (gspo 4e-4, grpo 0.27)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty against the reference policy (the policy RL starts from, after any
    warm start; saved in checkpoint.dir/reference); 0 = off (the GSPO paper omits it)."""
    kl_estimator: KLEstimatorName = "k3"
    """KL estimator of the loss term when kl_coef > 0 (algorithms/kl.py): k1, k2, k3, low_var_kl (k3
    clamped to [-10, 10]: verl's k3 and low_var_kl, ROLL's k3), abs."""
    loss_agg_mode: AggregationName = SEQUENCE_MEAN
    """How the per-token terms (and the KL term) become the loss, verl's and ROLL's modes:
    seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: the token sums over a
    constant, token_sum_norm), token-mean (over the trained tokens of the global batch). A loss
    takes the modes its LOSSES row lists: gspo and gspo_token only seq-mean-token-mean (the sequence
    ratio fixes it, Eq. 5), grpo all four (docs/algorithm.md "Loss aggregation")."""
    token_sum_norm: float | None = None
    """The constant C of seq-mean-token-sum-norm (each sequence's token sum is divided by it): Dr.
    GRPO's and verl's loss_scale_factor, usually the generation budget (rollout.max_new_tokens);
    required with that mode, null otherwise."""
    dual_clip_c: float | None = None
    """Dual clip for negative advantages (Ye et al. 2020; verl clip_ratio_c, slime eps_clip_c, ROLL's
    dual_clip_loss with c = 1 + 2 pg_clip): where A < 0 and the ratio (the sequence ratio s_i for
    gspo) exceeds c, the term is the constant -c A (zero gradient); null = off. c > 1."""
    # Train/inference mismatch corrections (algorithms/mismatch.py), for pi_old recomputed by
    # megatron while SGLang sampled: d_t = log pi_old(y_t) - log pi_engine(y_t), constants.
    tis_cap: float | None = None
    """Token-level truncated IS: each token's term times w_t = min(exp(d_t), C) (gspo: the row's
    term times the row mean of w_t); null = off. C >= 1, e.g. 2."""
    seq_is_cap: float | None = None
    """Sequence-level IS in GSPO's form: each row's term times min(exp(mean_t d_t), C), the
    geometric mean of the token ratios; null = off. C >= 1."""
    mis_cap: float | None = None
    """Masked IS: tokens (or sequences, mis_level) whose ratio exp(d_t) (or exp(mean_t d_t)) leaves
    [1/C, C] are dropped from the loss; null = off. C >= 1."""
    mis_level: Literal["token", "sequence"] = "token"
    """What mis_cap masks: single tokens, or whole sequences by their geometric-mean ratio."""

    def __post_init__(self) -> None:
        # Errors read "field=value: expected ..." so that the config can prefix its section.
        if self.name not in LOSSES:
            raise ValueError(f"name={self.name!r}: expected one of {sorted(LOSSES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: expected one of {KL_ESTIMATORS}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef={self.kl_coef!r}: expected >= 0")
        if self.kl_coef > 0 and not self.spec.rl:
            raise ValueError(f"kl_coef={self.kl_coef!r}: expected 0 with the {self.name} loss "
                             "(it takes no KL penalty)")
        for field in ("tis_cap", "seq_is_cap", "mis_cap"):
            cap = getattr(self, field)
            if cap is not None and not cap >= 1.0:
                raise ValueError(f"{field}={cap!r}: expected >= 1 (or null for off)")
            if cap is not None and not self.spec.rl:
                raise ValueError(f"{field}={cap!r}: expected null with the {self.name} loss")
        if self.mis_level not in ("token", "sequence"):
            raise ValueError(f"mis_level={self.mis_level!r}: expected 'token' or 'sequence'")
        self._check_aggregation()
        lo, hi = self.clip_range()
        if not 0 <= lo < 1:
            raise ValueError(f"eps_low={lo!r}: expected in [0, 1)")
        if not hi >= 0:
            raise ValueError(f"eps_high={hi!r}: expected >= 0")

    def _check_aggregation(self) -> None:
        if self.loss_agg_mode not in self.spec.aggregations:
            why = (" (GSPO's sequence ratio fixes its own: one term per sequence, Eq. 5)"
                   if self.name.startswith("gspo") else "")
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}: expected "
                             f"{' or '.join(self.spec.aggregations)} with the {self.name} loss{why}")
        norm = self.loss_agg_mode == "seq-mean-token-sum-norm"
        if norm and not (self.token_sum_norm is not None and self.token_sum_norm > 0):
            raise ValueError(f"token_sum_norm={self.token_sum_norm!r}: expected > 0 with loss_agg_mode="
                             "seq-mean-token-sum-norm (the constant each token sum is divided by, "
                             "e.g. rollout.max_new_tokens)")
        if not norm and self.token_sum_norm is not None:
            raise ValueError(f"token_sum_norm={self.token_sum_norm!r}: expected null unless "
                             "loss_agg_mode=seq-mean-token-sum-norm")
        if self.dual_clip_c is not None and not (self.dual_clip_c > 1 and self.spec.clip is not None):
            raise ValueError(f"dual_clip_c={self.dual_clip_c!r}: expected > 1 (or null for off), with a "
                             f"loss that clips (the {self.name} loss "
                             f"{'does' if self.spec.clip is not None else 'does not'})")

    @property
    def spec(self) -> LossSpec:
        return LOSSES[self.name]

    @property
    def counts_tokens(self) -> bool:
        """The loss is a mean over trained tokens (token-mean), not over sequences."""
        return self.loss_agg_mode == "token-mean"

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high): the configured values, else the paper's for this loss."""
        lo, hi = self.spec.clip or (0.0, 0.0)
        return (lo if self.eps_low is None else self.eps_low,
                hi if self.eps_high is None else self.eps_high)

    def function_kwargs(self) -> dict[str, float | str]:
        """Keyword arguments of the loss function: clip range (a loss that clips), and the KL term
        when it is on."""
        out: dict[str, float | str] = {}
        if self.spec.clip is not None:
            out["eps_low"], out["eps_high"] = self.clip_range()
        if self.kl_coef > 0:
            out.update(kl_coef=self.kl_coef, kl_estimator=self.kl_estimator)
        if self.loss_agg_mode != SEQUENCE_MEAN:  # a row with only the default never sees it
            out["loss_agg_mode"] = self.loss_agg_mode
        if self.token_sum_norm is not None:
            out["token_sum_norm"] = self.token_sum_norm
        if self.dual_clip_c is not None:
            out["dual_clip_c"] = self.dual_clip_c
        return out

    @property
    def corrects_mismatch(self) -> bool:
        """Any train/inference mismatch correction is on (it needs the engine's log-probs)."""
        return any(c is not None for c in (self.tis_cap, self.seq_is_cap, self.mis_cap))

    def mismatch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of mismatch.mismatch_correction."""
        return dict(tis_cap=self.tis_cap, seq_is_cap=self.seq_is_cap, mis_cap=self.mis_cap,
                    mis_level=self.mis_level)

    def describe(self) -> str:
        if not self.spec.rl:
            return f"loss={self.name}"
        lo, hi = self.clip_range()
        clip = f"eps_low={lo:g} eps_high={hi:g}" if self.spec.clip is not None else "no clip"
        kl = f"kl_coef={self.kl_coef} ({self.kl_estimator})" if self.kl_coef else "KL off"
        caps = "".join(f" {k}={v:g}" for k, v in self.mismatch_kwargs().items()
                       if k != "mis_level" and v is not None)
        if self.dual_clip_c is not None:
            clip += f" dual_clip_c={self.dual_clip_c:g}"
        agg = "" if self.loss_agg_mode == SEQUENCE_MEAN else f" {self.loss_agg_mode}"
        if self.token_sum_norm is not None:
            agg += f" (C={self.token_sum_norm:g})"
        return f"loss={self.name}{agg} {clip} {kl}{caps}"
