"""The actor's settings: plain dataclasses, no torch, one docstring per field.

The run config uses them as its sections (config.py: `train:` is an OptimizerSettings, `loss:` a
LossSettings), so a field is declared once and documented once; the actor can also be built
without a run config (tests, benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OLD_LOG_PROB_SOURCES = ("recompute", "engine")


@dataclass
class OptimizerSettings:
    """Optimizer, learning-rate schedule and gradient settings of the actor."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (adam = AdamW, decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (ignored by the constant schedule)."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which the learning rate decays from lr to min_lr (after warm-up);
    null = every optimizer step of the run (train.steps x train.mini_batches)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up (megatron's OptimizerParamScheduler)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum (megatron's default is 0.9; 0 makes one step exactly lr x gradient)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state (and the gradient reduce-scatter) over data-parallel ranks (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 when the model is bf16/fp16."""

    def __post_init__(self) -> None:
        # Errors read "field=value: expected ..." so that the config can prefix its section.
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.use_distributed_optimizer and self.optimizer != "adam":
            # megatron-core's DistributedOptimizer asserts Adam (checkpointing requirements).
            raise ValueError(f"use_distributed_optimizer=True needs optimizer='adam', got "
                             f"{self.optimizer!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps!r}: expected >= 1 or null")

    def decay_steps(self) -> int:
        """Steps of the learning-rate decay (the run config counts the run's optimizer steps)."""
        return self.lr_decay_steps or 1


@dataclass
class LogProbSettings:
    """How the last stage computes per-token log-probs."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts: log-probs are of softmax(logits / temperature)."""
    fused: bool = True
    """Compute log-probs from hidden states + output weight in token chunks (no full logits)."""
    chunk_tokens: int = 1024
    """Tokens per chunk of the fused path."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: expected > 0")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens!r}: expected >= 1")
