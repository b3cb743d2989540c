"""The one table of advantage estimators, and the advantage settings of the loss section.

    spec = ESTIMATORS["rloo"]                      # EstimatorSpec
    settings = AdvantageSettings(advantage_estimator="reinforce", whiten_advantages=True)

Two kinds. A "group" estimator scores each response (its reward, minus the KL when it is in the
reward) and gives it `A_i = (S_i - b_i) / d_i`, with a baseline b_i and a scale d_i from its
prompt's group (estimators.py). A "return" estimator gives each token its return-to-go
`G_t = sum_{t' >= t} gamma^(t' - t) r_t'` of the per-token rewards (the reward on the last trained
token, the KL penalty on every token). Then, for every estimator, optional whitening over the
trained tokens of the whole batch and an optional clip (pipeline.py). No torch here: the config is
checked before torch loads.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gspo_tables import SETTINGS_OF, TABLE, Table, load_object, row_settings

from ..terms import KL_ESTIMATORS


@dataclass
class GroupStd:
    """grpo's settings."""

    group_std: Literal["population", "unbiased"] = "population"
    """The std of the group's scores: population (the set's std, as GSPO Eq. 6 writes it) or
    unbiased (Bessel's correction, torch.std: what verl, ROLL and slime compute)."""

    def __post_init__(self) -> None:
        if self.group_std not in ("population", "unbiased"):
            raise ValueError(f"group_std={self.group_std!r}: expected 'population' or 'unbiased'")


@dataclass
class Discount:
    """The return estimators' settings."""

    gamma: float = 1.0
    """Discount of later tokens' rewards in the return-to-go (ROLL's, verl's and slime's gamma); 1 =
    every token of a response gets its whole reward."""

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma={self.gamma!r}: expected in (0, 1]")


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator: what the config, the pipeline and the docs need to know."""

    name: str
    kind: Literal["group", "return"]
    function: str | Callable[..., Any] | None
    """group: `package.module:function` (or the function), fn(stats, settings) -> (baseline, scale)
    per row (estimators.py; settings: its own, or None); return: None (the return-to-go is the
    advantage)."""
    whitens: bool
    """Always whitened over the batch's trained tokens (REINFORCE++), whiten_advantages or not."""
    description: str
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The peers' names for it ({"verl": ("rloo",), ...}: migrate reads them; docs/algorithm.md's table)."""
    settings: type | None = None
    """Its own settings (a dataclass), from loss.estimator_args; None: it takes none. A return
    estimator's settings have `gamma`."""

    def baseline_and_scale(self) -> Callable[..., Any] | None:
        if self.function is None or callable(self.function):
            return self.function
        fn = load_object(self.function, f"the {self.name} estimator's function")
        if not callable(fn):
            raise TypeError(f"the {self.name} estimator's function {self.function} is not callable")
        return fn


_E = "gspo_megatron.algorithms.advantage.estimators:"
ESTIMATORS: Table[EstimatorSpec] = Table("advantage estimator", EstimatorSpec, (
    EstimatorSpec("grpo", "group", _E + "group_mean_std", False,
                  "(S_i - mean_g) / (std_g + 1e-6); a group of equal scores gets 0 (GSPO Eq. 6)",
                  {"verl": ("grpo", "grpo_vectorized"), "roll": ("grpo",), "slime": ("grpo", "gspo")},
                  settings=GroupStd),
    EstimatorSpec("dr_grpo", "group", _E + "group_mean", False,
                  "S_i - mean_g: the group mean as baseline, no std (Dr. GRPO; verl's grpo with "
                  "norm_adv_by_std_in_grpo: false, slime's --disable-grpo-std-normalization)"),
    EstimatorSpec("rloo", "group", _E + "leave_one_out", False,
                  "S_i - mean of the group's other scores (RLOO)", {"verl": ("rloo", "rloo_vectorized")}),
    EstimatorSpec("reinforce_plus_plus_baseline", "group", _E + "group_mean", True,
                  "S_i - mean_g, whitened over the batch's tokens (REINFORCE++-baseline)",
                  {"verl": ("reinforce_plus_plus_baseline",), "slime": ("reinforce_plus_plus_baseline",)}),
    EstimatorSpec("reinforce", "return", None, False,
                  "return-to-go of the token rewards (whitened with whiten_advantages)",
                  {"roll": ("reinforce",)}, settings=Discount),
    EstimatorSpec("reinforce_plus_plus", "return", None, True,
                  "return-to-go of the token rewards, whitened over the batch's tokens (REINFORCE++)",
                  {"verl": ("reinforce_plus_plus",), "slime": ("reinforce_plus_plus",)}, settings=Discount),
), field="loss.advantage_estimator")
NORMS = ("batch", "group", "running")
NormName = Literal["batch", "group", "running"]


@dataclass
class AdvantageSettings:
    """How rewards become advantages (the loss section's advantage fields; pipeline.py applies
    them in this order: reward norm, reward clip, KL in the reward, estimator, whitening, clip)."""

    advantage_estimator: str = field(default="grpo", metadata={TABLE: lambda: ESTIMATORS})
    """A row of ESTIMATORS (gspo_megatron/algorithms/advantage/table.py), or package.module:Name of
    an EstimatorSpec of your own."""
    estimator_args: dict[str, Any] = field(default_factory=dict, metadata={SETTINGS_OF: "advantage_estimator"})
    """The estimator's own settings: grpo's {group_std: population | unbiased} (the std of the group:
    the set's, as GSPO Eq. 6 writes it, or Bessel-corrected as verl, ROLL and slime compute it); the
    return estimators' {gamma: 1.0} (the return-to-go's discount); {} for the others."""
    whiten_advantages: bool = False
    """Whiten the advantages over the trained tokens of the whole rollout batch (every data-parallel
    rank's rows: one mean and one std), (A - mean) / sqrt(var + 1e-8), var with Bessel's correction
    (ROLL's whiten_advantages, slime's --normalize-advantages); REINFORCE++ always does."""
    advantage_clip: float | None = None
    """Clip the advantages to [-c, c] after whitening (ROLL's advantage_clip); null = off."""
    reward_norm_mean: NormName | None = None
    """Subtract a mean from the rewards before the estimator (ROLL's norm_mean_type, or reward_norm
    with reward_shift): batch, group (the prompt's group), running (every reward of the run so far,
    kept in checkpoints); null = none."""
    reward_norm_std: NormName | None = None
    """Divide the rewards by a std (+ 1e-6, Bessel-corrected) before the estimator (ROLL's
    norm_std_type, or reward_norm with reward_scale): batch, group, running; null = none."""
    reward_clip: float | None = None
    """Clip the rewards to [-c, c] after the normalisation (and each token's reward again when the KL
    is in the reward: ROLL's reward_clip); null = off."""
    kl_in_reward_coef: float = 0.0
    """beta of a KL penalty in the reward: each trained token's reward gets -beta * KL_t(pi_old ||
    pi_ref) before the estimator (verl use_kl_in_reward + kl_ctrl.kl_coef, ROLL add_token_level_kl
    + init_kl_coef, slime --kl-coef); 0 = off. Computed where the reference log-probs are: on the
    last pipeline stage, with statistics over every data-parallel rank."""
    kl_in_reward_estimator: str = field(default="k1", metadata={TABLE: lambda: KL_ESTIMATORS})
    """Its per-token estimator (verl algorithm.kl_penalty, ROLL kl_penalty), a row of KL_ESTIMATORS
    (gspo_megatron/algorithms/terms.py)."""

    def __post_init__(self) -> None:
        # Errors read "field=value: expected ..." so that the config can prefix its section.
        ESTIMATORS.row(self.advantage_estimator, "advantage_estimator")
        self.estimator_settings = row_settings(self.estimator, self.estimator_args, "estimator_args")
        for name in ("advantage_clip", "reward_clip"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}={v!r}: expected > 0 (or null for off)")
        for name in ("reward_norm_mean", "reward_norm_std"):
            v = getattr(self, name)
            if v is not None and v not in NORMS:
                raise ValueError(f"{name}={v!r}: expected one of {NORMS} or null")
        if not self.kl_in_reward_coef >= 0:
            raise ValueError(f"kl_in_reward_coef={self.kl_in_reward_coef!r}: expected >= 0")
        KL_ESTIMATORS.row(self.kl_in_reward_estimator, "kl_in_reward_estimator")

    @property
    def estimator(self) -> EstimatorSpec:
        return ESTIMATORS.row(self.advantage_estimator, "advantage_estimator")

    @property
    def gamma(self) -> float:
        """The return-to-go's discount: a return estimator's setting, 1 for the others."""
        return float(getattr(self.estimator_settings, "gamma", 1.0))

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in_reward_coef > 0

    @property
    def group_relative(self) -> bool:
        """Some advantage is relative to the prompt's group (a group of one would get 0 there)."""
        return self.estimator.kind == "group" or "group" in (self.reward_norm_mean, self.reward_norm_std)

    def per_token(self, turn_credit: str = "episode") -> bool:
        """The advantages differ along a response (they are then one per token): a return
        estimator with a discount, the KL in the reward or per-turn rewards; a group estimator
        with per-turn credit."""
        if turn_credit == "return_to_go":
            return True
        return self.estimator.kind == "return" and (self.gamma < 1 or self.kl_in_reward)

    def describe(self) -> str:
        parts = [f"advantage={self.advantage_estimator}"]
        if self.estimator_settings is not None:
            defaults = self.estimator.settings()  # type: ignore[misc]
            for key, value in vars(self.estimator_settings).items():
                if value != getattr(defaults, key):  # what differs from the estimator's own defaults
                    parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
        norm = [f"{k}={v}" for k, v in (("mean", self.reward_norm_mean), ("std", self.reward_norm_std)) if v]
        if norm:
            parts.append("reward norm " + " ".join(norm))
        if self.reward_clip is not None:
            parts.append(f"reward_clip={self.reward_clip:g}")
        if self.kl_in_reward:
            parts.append(f"KL in reward {self.kl_in_reward_coef:g} ({self.kl_in_reward_estimator})")
        if self.whiten_advantages or self.estimator.whitens:
            parts.append("whitened")
        if self.advantage_clip is not None:
            parts.append(f"advantage_clip={self.advantage_clip:g}")
        return " ".join(parts)
