"""The parallel layout of one trainer job, and the checks that reject impossible layouts early.

A layout that does not fit the world size or the model must fail before any collective is issued:
a wrong split otherwise shows up as a hang in the first all-reduce, minutes later.
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the numbers that do not fit."""


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split. Data parallel size is whatever is left of the world size."""

    tensor: int = 1
    """Tensor-parallel size (TP): attention heads and MLP columns split across this many ranks."""
    pipeline: int = 1
    """Pipeline-parallel size (PP): transformer layers split into this many stages."""
    virtual_pipeline: int | None = None
    """Virtual stages per pipeline rank (interleaved schedule, VPP); None or 1 = not interleaved."""
    expert: int = 1
    """Expert-parallel size (EP): MoE experts split across this many ranks."""
    expert_tensor: int | None = None
    """Tensor-parallel size inside each expert (expert-TP); None = same as `tensor`."""
    sequence_parallel: bool | None = None
    """Split activations along the sequence between TP ranks (SP). None = on when tensor > 1 and
    the model is MoE (megatron-core requires it then), off otherwise."""

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline or 1

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline)

    def use_sequence_parallel(self, is_moe: bool) -> bool:
        if self.sequence_parallel is None:
            return self.tensor > 1 and is_moe
        return self.sequence_parallel

    def describe(self, world_size: int) -> str:
        parts = [f"TP{self.tensor}", f"PP{self.pipeline}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        parts += [f"EP{self.expert}", f"ETP{self.etp}", f"DP{self.data_parallel(world_size)}"]
        return "x".join(parts)

    def transformer_config_fields(self, is_moe: bool) -> dict:
        """The TransformerConfig fields this layout decides (model_specs takes them as overrides)."""
        return dict(
            tensor_model_parallel_size=self.tensor,
            pipeline_model_parallel_size=self.pipeline,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
            expert_model_parallel_size=self.expert,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.use_sequence_parallel(is_moe),
            # Per-micro-batch sequence lengths differ in RL: PP stages exchange shapes first.
            variable_seq_lengths=self.pipeline > 1,
            # Also for dense models: TransformerConfig rejects variable_seq_lengths with the
            # default allgather dispatcher even when there are no experts.
            moe_token_dispatcher_type="alltoall",
        )

    def validate(self, world_size: int, *, num_layers: int, num_attention_heads: int,
                 num_query_groups: int, vocab_size: int, num_experts: int | None = None) -> None:
        """Raise LayoutError naming the numbers if this layout cannot run the model on world_size."""
        self.validate_sizes()
        tp, pp, ep, etp = self.tensor, self.pipeline, self.expert, self.etp
        if world_size % (tp * pp):
            raise LayoutError(f"world size {world_size} is not divisible by tensor x pipeline = "
                              f"{tp} x {pp} = {tp * pp}")
        if world_size % (etp * ep * pp):
            raise LayoutError(f"world size {world_size} is not divisible by expert_tensor x expert x "
                              f"pipeline = {etp} x {ep} x {pp} = {etp * ep * pp}")
        self.validate_model(num_layers=num_layers, num_attention_heads=num_attention_heads,
                            num_query_groups=num_query_groups, vocab_size=vocab_size,
                            num_experts=num_experts)

    def validate_sizes(self) -> None:
        """The sizes themselves (>= 1; VPP needs PP), without a world size or a model."""
        for name in ("tensor", "pipeline", "expert"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor is not None and self.expert_tensor < 1:
            raise LayoutError(f"parallel.expert_tensor must be >= 1, got {self.expert_tensor}")
        if self.virtual_pipeline is not None and self.virtual_pipeline < 1:
            raise LayoutError(f"parallel.virtual_pipeline must be >= 1, got {self.virtual_pipeline}")
        if self.vpp > 1 and self.pipeline == 1:
            raise LayoutError(f"virtual_pipeline={self.vpp} needs pipeline > 1, got pipeline=1")

    def validate_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                       vocab_size: int, num_experts: int | None = None) -> None:
        """The checks that need the model's dimensions but not the world size."""
        self.validate_sizes()
        tp, pp, vpp, ep = self.tensor, self.pipeline, self.vpp, self.expert
        if num_layers % (pp * vpp):
            raise LayoutError(f"num_layers {num_layers} is not divisible by pipeline x "
                              f"virtual_pipeline = {pp} x {vpp} = {pp * vpp}")
        if num_attention_heads % tp:
            raise LayoutError(f"num_attention_heads {num_attention_heads} is not divisible by "
                              f"tensor {tp}")
        if num_query_groups % tp:
            raise LayoutError(f"num_key_value_heads (query groups) {num_query_groups} is not "
                              f"divisible by tensor {tp}")
        if vocab_size % tp:
            raise LayoutError(f"vocab_size {vocab_size} is not divisible by tensor {tp} (the "
                              "vocab-parallel log-probs use the exact vocabulary, no padding)")
        if num_experts:
            if num_experts % ep:
                raise LayoutError(f"num_experts {num_experts} is not divisible by expert {ep}")
            if tp > 1 and self.sequence_parallel is False:
                raise LayoutError("an MoE model with tensor > 1 needs sequence_parallel=True "
                                  "(megatron-core requirement)")
        elif ep > 1:
            raise LayoutError(f"expert={ep} but the model is dense (no experts)")
