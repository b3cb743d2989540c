"""The one table of policy losses: names, the paper's clip ranges, advantage shapes, metric keys.

    spec = LOSSES["gspo"]            # LossSpec
    loss, metrics = spec.loss_function()(log_probs, old_log_probs, advantages, loss_mask, ...)
    settings = LossSettings(name="grpo")   # clip_range() -> the paper's (0.2, 0.27)

The run config (gspo_megatron/config/schema.py), the actor (actor/steps.py) and the package's exports
read this table; nothing else writes a loss name, a default clip range or a metric key. A loss from
outside the package is a LossSpec in an installed module: `loss.name: my_pkg.losses:CISPO`, or
registered by a `plugins:` module (docs/extending.md). The module imports no torch (the config is
validated before torch is imported), so the functions are named here and imported on first use.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gspo_tables import SETTINGS_OF, TABLE, Table, load_object, row_settings

from .terms import AGGREGATIONS, KL_ESTIMATORS, SEQUENCE_MEAN, Aggregation

# The paper's clip ranges (arXiv 2507.18071 §5.1): GSPO 3e-4 / 4e-4; the GRPO baseline 0.2 / 0.27.
GSPO_CLIP = (3e-4, 4e-4)
GRPO_CLIP = (0.2, 0.27)

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
# The metric keys of a loss with an importance ratio (a row's metric_keys; gspo adds clipped_sequences).
RATIO_KEYS = ("num_sequences", "num_tokens", "clipped_tokens", "seq_ratio_sum", "seq_ratio_min",
               "seq_ratio_max")


@dataclass(frozen=True)
class LossSpec:
    """One policy loss: what the config, the actor and the metrics need to know about it."""

    name: str
    function: str | Callable[..., Any] | None
    """`package.module:function` (or the function itself); None for "ce" (the actor computes it).
    Called per micro-batch as fn(log_probs, old_log_probs, advantages, loss_mask, *, reduction,
    loss_agg_mode, ...) (gspo.py's gspo_loss is the model)."""
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
    aggregations: tuple[str, ...] | None = (SEQUENCE_MEAN,)
    """The rows of AGGREGATIONS (`loss_agg_mode`) its function computes; None: every row, a
    plug-in's included (gspo, gspo_token and grpo; the default stays seq-mean-token-mean, GSPO's
    Eq. 5). A plug-in loss that computes only the default keeps this default."""
    settings: type | None = None
    """Its own settings (a dataclass), from loss.loss_args: passed to its function as keyword
    arguments. None: it takes none."""
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The peers' names for it ({"verl": ("vanilla",)}; migrate reads them)."""

    @property
    def takes_token_advantages(self) -> bool:
        return self.advantages == "token" or self.also_token_advantages

    def takes_aggregation(self, name: str) -> bool:
        return name in AGGREGATIONS and (self.aggregations is None or name in self.aggregations)

    def aggregation_names(self) -> tuple[str, ...]:
        return tuple(AGGREGATIONS) if self.aggregations is None else self.aggregations

    def loss_function(self) -> Callable[..., Any] | None:
        if self.function is None or callable(self.function):
            return self.function
        fn = load_object(self.function, f"the {self.name} loss's function")
        if not callable(fn):
            raise TypeError(f"the {self.name} loss's function {self.function} is not callable")
        return fn

    def reported_keys(self, with_kl: bool) -> dict[str, str]:
        """{metric key: reduction op} this loss reports per micro-batch."""
        keys = list(self.metric_keys) + (["kl_sum"] if with_kl else [])
        return {k: METRIC_REDUCTIONS[k] for k in keys}


LOSSES: Table[LossSpec] = Table("loss", LossSpec, (
    LossSpec("gspo", "gspo_megatron.algorithms.gspo:gspo_loss", GSPO_CLIP, "sequence",
             RATIO_KEYS + ("clipped_sequences",),
             "sequence-level ratio s_i = exp(mean log-ratio), clipped per sequence (Eqs. 5-7)",
             also_token_advantages=True, aggregations=None,
             peers={"verl": ("gspo",), "roll": ("seq",), "slime": ("gspo",)}),
    LossSpec("gspo_token", "gspo_megatron.algorithms.gspo:gspo_token_loss", GSPO_CLIP, "token", RATIO_KEYS,
             "GSPO-token: s_i per token with per-token advantages (Eqs. 13-14)", aggregations=None),
    LossSpec("grpo", "gspo_megatron.algorithms.grpo:grpo_loss", GRPO_CLIP, "sequence", RATIO_KEYS,
             "GRPO baseline: token-level ratios (Eqs. 2-3)", also_token_advantages=True,
             aggregations=None, peers={"verl": ("vanilla",), "roll": ("token",), "slime": ("grpo",)}),
    LossSpec("ce", None, None, "sequence", ("num_sequences", "num_tokens"),
             "next-token cross-entropy over trained tokens (warm start, cost comparisons)", rl=False),
), field="loss.name")


def rl_losses() -> dict[str, str]:
    """{name: description} of the losses the run config may select (every row but "ce")."""
    return {name: row.description for name, row in LOSSES.items() if row.rl}


@dataclass
class LossSettings:
    """Which loss the train step applies on the last pipeline stage, and its parameters."""

    name: str = field(default="gspo", metadata={TABLE: lambda: LOSSES})
    """A row of LOSSES (gspo_megatron/algorithms/registry.py), or package.module:Name of a LossSpec
    of your own: gspo (sequence ratio, Eqs. 5-7), gspo_token (Eqs. 13-14), grpo (token ratio), ..."""
    loss_args: dict[str, Any] = field(default_factory=dict, metadata={SETTINGS_OF: "name"})
    """The loss's own settings, for a loss that declares some (its LossSpec.settings); {} otherwise."""
    eps_low: float | None = None
    """Lower clip range; null = the paper's value for the loss (gspo 3e-4, grpo 0.2)."""
    eps_high: float | None = None
    """Upper clip range; null = the paper's value for the loss (gspo 4e-4, grpo 0.27)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty against the reference policy (the policy RL starts from, after any
    warm start; saved in checkpoint.dir/reference); 0 = off (the GSPO paper omits it)."""
    kl_estimator: str = field(default="k3", metadata={TABLE: lambda: KL_ESTIMATORS})
    """KL estimator of the loss term when kl_coef > 0, a row of KL_ESTIMATORS
    (gspo_megatron/algorithms/terms.py)."""
    loss_agg_mode: str = field(default=SEQUENCE_MEAN, metadata={TABLE: lambda: AGGREGATIONS})
    """How the per-token terms (and the KL term) become the loss, a row of AGGREGATIONS
    (gspo_megatron/algorithms/terms.py; verl's and ROLL's agg_loss modes). The default is the
    paper's: one term per sequence (GSPO Eq. 5). gspo and gspo_token take the others as ROLL's
    importance_sampling: seq does (the sequence ratio on each trained token, the tokens' terms
    aggregated: with token sums a sequence weighs by its length); grpo every one
    (docs/algorithm.md "Loss aggregation")."""
    aggregation_args: dict[str, Any] = field(default_factory=dict, metadata={SETTINGS_OF: "loss_agg_mode"})
    """The aggregation's own settings: seq-mean-token-sum-norm's {token_sum_norm: C} (Dr. GRPO's and
    verl's loss_scale_factor, usually rollout.max_new_tokens); {} for the others."""
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
        LOSSES.row(self.name, "name")
        KL_ESTIMATORS.row(self.kl_estimator, "kl_estimator")
        self.loss_settings = row_settings(self.spec, self.loss_args, "loss_args")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef={self.kl_coef!r}: expected >= 0")
        if self.kl_coef > 0 and not self.spec.rl:
            raise ValueError(f"kl_coef={self.kl_coef!r}: expected 0 with the {self.name} loss "
                             "(it takes no KL penalty)")
        for name in ("tis_cap", "seq_is_cap", "mis_cap"):
            cap = getattr(self, name)
            if cap is not None and not cap >= 1.0:
                raise ValueError(f"{name}={cap!r}: expected >= 1 (or null for off)")
            if cap is not None and not self.spec.rl:
                raise ValueError(f"{name}={cap!r}: expected null with the {self.name} loss")
        if self.mis_level not in ("token", "sequence"):
            raise ValueError(f"mis_level={self.mis_level!r}: expected 'token' or 'sequence'")
        self._check_aggregation()
        lo, hi = self.clip_range()
        if not 0 <= lo < 1:
            raise ValueError(f"eps_low={lo!r}: expected in [0, 1)")
        if not hi >= 0:
            raise ValueError(f"eps_high={hi!r}: expected >= 0")

    def _check_aggregation(self) -> None:
        if not self.spec.takes_aggregation(self.loss_agg_mode):
            AGGREGATIONS.row(self.loss_agg_mode, "loss_agg_mode")  # an unknown name is named first
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}: expected "
                             f"{' or '.join(self.spec.aggregation_names())} with the {self.name} loss")
        self.aggregation = Aggregation.of(self.loss_agg_mode, self.aggregation_args, "aggregation_args")
        if self.dual_clip_c is not None and not (self.dual_clip_c > 1 and self.spec.clip is not None):
            raise ValueError(f"dual_clip_c={self.dual_clip_c!r}: expected > 1 (or null for off), with a "
                             f"loss that clips (the {self.name} loss "
                             f"{'does' if self.spec.clip is not None else 'does not'})")

    @property
    def spec(self) -> LossSpec:
        return LOSSES.row(self.name, "name")

    @property
    def counts_tokens(self) -> bool:
        """The loss is a mean over trained tokens (token-mean), not over sequences."""
        return self.aggregation.spec.divides_by == "tokens"

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high): the configured values, else the paper's for this loss."""
        lo, hi = self.spec.clip or (0.0, 0.0)
        return (lo if self.eps_low is None else self.eps_low,
                hi if self.eps_high is None else self.eps_high)

    def function_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the loss function: clip range (a loss that clips), the KL term when
        it is on, the aggregation (with its settings) unless it is the default, the loss's own
        settings."""
        out: dict[str, Any] = {}
        if self.spec.clip is not None:
            out["eps_low"], out["eps_high"] = self.clip_range()
        if self.kl_coef > 0:
            out.update(kl_coef=self.kl_coef, kl_estimator=self.kl_estimator)
        if self.aggregation.name != SEQUENCE_MEAN:  # a row with only the default never sees it
            out["loss_agg_mode"] = self.aggregation
        if self.dual_clip_c is not None:
            out["dual_clip_c"] = self.dual_clip_c
        if self.loss_settings is not None:
            out.update(vars(self.loss_settings))
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
        agg = "" if self.aggregation.name == SEQUENCE_MEAN else f" {self.aggregation.describe()}"
        own = "" if self.loss_settings is None else f" {self.loss_settings}"
        return f"loss={self.name}{own}{agg} {clip} {kl}{caps}"
