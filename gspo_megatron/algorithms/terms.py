"""The two tables of how a loss's terms are formed: AGGREGATIONS (per-token terms -> each row's term
-> the loss) and KL_ESTIMATORS (the per-token estimate of KL(pi || pi_ref)). Torch-free: the config
checks its names here before torch loads; each row names its function (rows.py, kl.py), imported
on first use.

    AGGREGATIONS["seq-mean-token-sum-norm"].settings    # TokenSumNorm: its constant C
    KL_ESTIMATORS["low_var_kl"].peers["verl"]           # ("k3", "low_var_kl"): verl's names for it

A row from outside the package is an `AggregationSpec` / `KLEstimatorSpec` in an installed module,
named `package.module:NAME` in the config or registered by a `plugins:` module
(docs/extending.md).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gspo_tables import Table, load_object, row_settings


def _function(path_or_function: str | Callable[..., Any], where: str) -> Callable[..., Any]:
    if callable(path_or_function):
        return path_or_function
    fn = load_object(path_or_function, where)
    if not callable(fn):
        raise TypeError(f"{where}: {path_or_function} is not callable")
    return fn


@dataclass
class TokenSumNorm:
    """The settings of seq-mean-token-sum-norm (Dr. GRPO)."""

    token_sum_norm: float = 0.0
    """The constant C each sequence's token sum is divided by: Dr. GRPO's and verl's
    loss_scale_factor, usually the generation budget (rollout.max_new_tokens). Required (> 0)."""

    def __post_init__(self) -> None:
        if not self.token_sum_norm > 0:
            raise ValueError(f"token_sum_norm={self.token_sum_norm!r}: expected > 0 (the constant each "
                             "sequence's token sum is divided by, e.g. rollout.max_new_tokens)")


@dataclass(frozen=True)
class AggregationSpec:
    """How a loss's per-token terms l_it become the loss: each row's term, then a mean over the
    rows or over the trained tokens of the global batch."""

    name: str
    function: str | Callable[..., Any]
    """`package.module:function` (or the function): fn(rows, per_token `[b, s]`, settings) -> `[b]`
    each row's term, summed over the context-parallel group (rows.Rows.sum / mean do that)."""
    divides_by: Literal["sequences", "tokens"]
    """What the loss's mean divides the summed row terms by: the rows with a trained token (N) or
    the trained tokens (T) of the global batch."""
    description: str
    settings: type | None = None
    """Its own settings, from loss.aggregation_args (None: it takes none)."""
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The peers' names for it ({"verl": (...), "roll": (...), "slime": (...)}; migrate reads them)."""

    def row_terms(self) -> Callable[..., Any]:
        return _function(self.function, f"the {self.name} aggregation's function")


def _peers(name: str, **more: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """verl's and ROLL's agg_loss modes have our names."""
    return {"verl": (name,), "roll": (name,), **more}


AGGREGATIONS: Table[AggregationSpec] = Table("loss aggregation", AggregationSpec, (
    AggregationSpec("seq-mean-token-mean", "gspo_megatron.algorithms.rows:token_mean", "sequences",
                    "(1/N) sum_i (1/L_i) sum_t l_it: each sequence one term (GSPO Eq. 5)",
                    peers=_peers("seq-mean-token-mean")),
    AggregationSpec("seq-mean-token-sum", "gspo_megatron.algorithms.rows:token_sum", "sequences",
                    "(1/N) sum_i sum_t l_it: sequences weighed by their length",
                    peers=_peers("seq-mean-token-sum")),
    AggregationSpec("seq-mean-token-sum-norm", "gspo_megatron.algorithms.rows:token_sum_over_constant",
                    "sequences", "(1/N) sum_i sum_t l_it / C (Dr. GRPO)", settings=TokenSumNorm,
                    peers=_peers("seq-mean-token-sum-norm")),
    AggregationSpec("token-mean", "gspo_megatron.algorithms.rows:token_sum", "tokens",
                    "(1/T) sum_i sum_t l_it over the global batch's trained tokens",
                    peers=_peers("token-mean", slime=("calculate-per-token-loss",))),
), field="loss.loss_agg_mode")
SEQUENCE_MEAN = "seq-mean-token-mean"
"""The default aggregation: GSPO's (a mean over sequences of one term each, Eq. 5)."""


@dataclass(frozen=True)
class Aggregation:
    """A row of AGGREGATIONS with its own settings: what a loss function is given as loss_agg_mode
    (a plain name works too for a row that takes no settings)."""

    name: str = SEQUENCE_MEAN
    settings: Any = None

    @classmethod
    def of(cls, mode: Aggregation | str, args: Mapping[str, Any] | None = None,
           field: str = "loss.aggregation_args") -> Aggregation:
        """`mode` as an Aggregation, its settings built from `args` (ValueError naming the field)."""
        if isinstance(mode, Aggregation):
            return mode
        return cls(mode, row_settings(AGGREGATIONS.row(mode, "loss_agg_mode"), args, field))

    @property
    def spec(self) -> AggregationSpec:
        return AGGREGATIONS.row(self.name, "loss_agg_mode")

    def describe(self) -> str:
        own = "" if self.settings is None else " (" + ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in vars(self.settings).items()) + ")"
        return f"{self.name}{own}"


@dataclass(frozen=True)
class KLEstimatorSpec:
    """One per-token estimator of KL(pi || pi_ref) from samples of pi, in d = log pi - log pi_ref
    (Schulman, "Approximating KL divergence", 2020)."""

    name: str
    function: str | Callable[..., Any]
    """`package.module:function` (or the function): fn(d `[...]`) -> the estimate, elementwise,
    differentiable in d."""
    description: str
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The peers' names for it ({"verl": ("kl", "k1"), ...}; migrate reads them)."""

    def estimate(self) -> Callable[..., Any]:
        return _function(self.function, f"the {self.name} KL estimator's function")


KL_ESTIMATORS: Table[KLEstimatorSpec] = Table("KL estimator", KLEstimatorSpec, (
    KLEstimatorSpec("k1", "gspo_megatron.algorithms.kl:k1", "d (unbiased, can be negative)",
                    peers={"verl": ("kl", "k1"), "roll": ("kl",), "slime": ("k1",)}),
    KLEstimatorSpec("k2", "gspo_megatron.algorithms.kl:k2", "d^2 / 2",
                    peers={"verl": ("mse", "k2"), "roll": ("mse",), "slime": ("k2",)}),
    KLEstimatorSpec("k3", "gspo_megatron.algorithms.kl:k3", "exp(-d) + d - 1 (unbiased, >= 0; -d clamped to +-20)",
                    peers={"slime": ("k3",)}),
    KLEstimatorSpec("low_var_kl", "gspo_megatron.algorithms.kl:low_var_kl",
                    "k3 clamped to [-10, 10] (its gradient is 0 beyond)",
                    peers={"verl": ("k3", "low_var_kl"), "roll": ("k3",), "slime": ("low_var_kl",)}),
    KLEstimatorSpec("abs", "gspo_megatron.algorithms.kl:abs_kl", "|d|", peers={"verl": ("abs",), "roll": ("abs",)}),
), field="loss.kl_estimator")

