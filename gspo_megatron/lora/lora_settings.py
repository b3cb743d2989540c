"""LoRA's settings: the `lora:` section of the run config, torch-free (a config error costs no
import of torch).

    LoraSettings(rank=32, alpha=64, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                 experts="per_expert", lr=1e-5)

A base that never changes plus adapters that do: the model is built as always, then every targeted
linear layer gets a low-rank adapter, delta(x) = alpha / rank * B A x, with B zero at the start (the
first policy is the base, bit for bit), and only the adapters are trained, saved and synced
(gspo_megatron/lora/). Targets are megatron's module names; in an MoE layer linear_fc1 and
linear_fc2 name the shared experts' MLP and, unless `experts: none`, the routed experts' too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""What an adapter can sit on: attention's fused q/k/v and output projections, an MLP's
[gate; up] and down projections (dense MLPs, shared experts and routed experts)."""
EXPERT_LAYOUTS = ("none", "per_expert", "shared_outer")
ROUTER_NAMES = ("router", "gate", "mlp.gate", "mlp.router")
"""Names users give the MoE router; an adapter there is refused (below)."""


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (module docstring); rank 0 trains every weight instead."""

    rank: int = 0
    """Rank r of every adapter; 0 = off (full fine-tuning). Rank 32 on Qwen3-30B-A3B keeps about
    6 GB of adapters with their Adam state instead of 366 GB (`gspo-megatron plan`)."""
    alpha: float | None = None
    """Scale numerator: an adapter adds alpha / rank * B A x; null = rank (a scale of 1)."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """The linear layers that get adapters, by megatron's module name: linear_qkv, linear_proj
    (attention), linear_fc1, linear_fc2 (dense MLPs, shared experts, and routed experts unless
    `experts: none`). Adapters on the MoE router are refused: a change there moves routing, which
    SGLang cannot serve as LoRA."""
    experts: Literal["none", "per_expert", "shared_outer"] = "per_expert"
    """Routed experts' adapters: none; per_expert (each expert its own A and B); shared_outer
    (fc1's A and fc2's B shared by every expert of a layer, the rest per expert: SGLang's
    --experts-shared-outer-loras contract). Refused with expert tensor parallelism > 1."""
    lr: float | None = None
    """Peak learning rate of the adapters; null = train.lr. Adapters usually train at 1e-5 to 1e-4
    where full RL fine-tuning uses 1e-6."""

    def __post_init__(self) -> None:
        # Errors read "field=value: expected ..." so that the config can prefix its section.
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank={self.rank!r}: expected an integer >= 0 (0 = off)")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha!r}: expected > 0, or null (= rank)")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr={self.lr!r}: expected > 0, or null (= train.lr)")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts={self.experts!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
        targets = list(self.targets)
        router = [t for t in targets if t in ROUTER_NAMES]
        if router:
            raise ValueError(f"targets={targets!r}: adapters on the router ({router[0]}) are refused: "
                             "a change there moves every token's experts, which SGLang serves from "
                             "the base router, so trainer and server would route differently")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"targets={targets!r}: {unknown[0]!r} is not a target; expected some of "
                             f"{', '.join(TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets={targets!r}: a target is named twice")
        if self.rank and not targets:
            raise ValueError(f"targets=[] with rank={self.rank}: expected at least one of "
                             f"{', '.join(TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, what every adapter's B A x is multiplied by."""
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def expert_targets(self) -> tuple[str, ...]:
        """The routed experts' targets (linear_fc1 and/or linear_fc2), empty with `experts: none`."""
        if self.experts == "none":
            return ()
        return tuple(t for t in ("linear_fc1", "linear_fc2") if t in self.targets)

    def describe(self) -> str:
        if not self.enabled:
            return "LoRA off (every weight trains)"
        lr = "train.lr" if self.lr is None else f"{self.lr:g}"
        return (f"LoRA rank {self.rank} alpha {self.alpha if self.alpha is not None else self.rank:g} on "
                f"{', '.join(self.targets)}, routed experts {self.experts}, lr {lr}")
