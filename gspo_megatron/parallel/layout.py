"""The parallel layout of one trainer job, and the checks that reject impossible layouts early.

A layout that does not fit the world size or the model must fail before any collective is issued:
a wrong split otherwise shows up as a hang in the first all-reduce, minutes later. How the layers
split over (virtual) pipeline stages, uneven first/last stages included, is megatron-core's rule,
re-stated here (validate_layers, stage_layers) and compared with megatron's own functions by
tests/parallel/test_layout_uneven_pipeline.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from gspo_errors import InputError


class LayoutError(InputError, ValueError):
    """An impossible parallel layout; the message names the numbers that do not fit."""


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split. Data parallel size is whatever is left of the world size after
    tensor x pipeline x context."""

    tensor: int = 1
    """Tensor-parallel size (TP): attention heads and MLP columns split across this many ranks."""
    pipeline: int = 1
    """Pipeline-parallel size (PP): transformer layers split into this many stages."""
    virtual_pipeline: int | None = None
    """Virtual stages per pipeline rank (interleaved schedule, VPP); None or 1 = not interleaved."""
    first_stage_layers: int | None = None
    """Transformer layers on the first pipeline stage (uneven pipeline, megatron-core's
    num_layers_in_first_pipeline_stage), e.g. fewer to leave room for the embedding; None = an
    even share. The layers not on an uneven first/last stage split evenly over the other stages;
    with VPP every stage's layers split evenly over its virtual stages. Needs pipeline > 1."""
    last_stage_layers: int | None = None
    """Transformer layers on the last pipeline stage (megatron-core's
    num_layers_in_last_pipeline_stage), e.g. fewer to leave room for the output layer and the
    log-probs; None = an even share. Same rules as first_stage_layers; with VPP and pipeline=2
    set only one of the two (megatron-core cannot build that split)."""
    expert: int = 1
    """Expert-parallel size (EP): MoE experts split across this many ranks."""
    expert_tensor: int | None = None
    """Tensor-parallel size inside each expert (expert-TP); None = same as `tensor`."""
    sequence_parallel: bool | None = None
    """Split activations along the sequence between TP ranks (SP). None = on when tensor > 1 and
    the model is MoE (megatron-core requires it then), off otherwise."""
    context: int = 1
    """Context-parallel size (CP): each sequence split over this many ranks, every rank holding
    two of its 2 x context chunks (megatron's load-balanced split, parallel/context.py); the GSPO
    per-sequence sums are reduced over them (algorithms/rows.py). Attention exchanges keys and
    values between them, which needs Transformer Engine's attention on CUDA (megatron's local
    attention does not support CP). Data parallel = world / (tensor x pipeline x context)."""

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline or 1

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline * self.context)

    def use_sequence_parallel(self, is_moe: bool) -> bool:
        if self.sequence_parallel is None:
            return self.tensor > 1 and is_moe
        return self.sequence_parallel

    @property
    def uneven(self) -> bool:
        """True if the first or the last pipeline stage has a set number of layers."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers on each pipeline rank (all its virtual stages), first to last, as
        megatron-core builds them (transformer_block.get_num_layers_to_build). Validates first."""
        self.validate_layers(num_layers)
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pipeline - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        per_middle = middle // middle_stages if middle_stages else 0
        sizes = [per_middle] * self.pipeline
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def virtual_stage_layers(self, num_layers: int) -> list[list[range]]:
        """The global layer indices of each [virtual stage][pipeline rank], in megatron-core's
        order (transformer_layer.get_transformer_layer_offset): virtual stage 0 of every rank,
        then virtual stage 1, ... Without VPP one virtual stage of contiguous ranges."""
        sizes = [n // self.vpp for n in self.stage_layers(num_layers)]
        out, start = [], 0
        for _ in range(self.vpp):
            row = []
            for n in sizes:
                row.append(range(start, start + n))
                start += n
            out.append(row)
        return out

    def describe(self, world_size: int) -> str:
        pp = f"PP{self.pipeline}"
        if self.uneven:
            ends = [f"{name}={n}" for name, n in (("first", self.first_stage_layers),
                                                  ("last", self.last_stage_layers))
                    if n is not None]
            pp += f"({','.join(ends)})"
        parts = [f"TP{self.tensor}", pp]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.context > 1:
            parts.append(f"CP{self.context}")
        parts += [f"EP{self.expert}", f"ETP{self.etp}", f"DP{self.data_parallel(world_size)}"]
        return "x".join(parts)

    def transformer_config_fields(self, is_moe: bool) -> dict:
        """The TransformerConfig fields this layout decides (model_specs takes them as overrides)."""
        return dict(
            tensor_model_parallel_size=self.tensor,
            pipeline_model_parallel_size=self.pipeline,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
            expert_model_parallel_size=self.expert,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.use_sequence_parallel(is_moe),
            context_parallel_size=self.context,
            # Per-micro-batch sequence lengths differ in RL: PP stages exchange shapes first.
            variable_seq_lengths=self.pipeline > 1,
            # Also for dense models: TransformerConfig rejects variable_seq_lengths with the
            # default allgather dispatcher even when there are no experts.
            moe_token_dispatcher_type="alltoall",
        ) | (dict(cp_comm_type="p2p") if self.context > 1 else {})  # TE's ring exchange of K/V

    def validate(self, world_size: int, *, num_layers: int, num_attention_heads: int,
                 num_query_groups: int, vocab_size: int, num_experts: int | None = None,
                 linear_num_key_heads: int | None = None) -> None:
        """Raise LayoutError naming the numbers if this layout cannot run the model on world_size."""
        self.validate_sizes()
        tp, pp, ep, etp, cp = self.tensor, self.pipeline, self.expert, self.etp, self.context
        if world_size % (tp * pp):
            raise LayoutError(f"world size {world_size} is not divisible by tensor x pipeline = "
                              f"{tp} x {pp} = {tp * pp}")
        if world_size % (tp * pp * cp):
            raise LayoutError(f"world size {world_size} is not divisible by tensor x pipeline x "
                              f"context = {tp} x {pp} x {cp} = {tp * pp * cp}")
        if world_size % (etp * ep * pp):
            raise LayoutError(f"world size {world_size} is not divisible by expert_tensor x expert x "
                              f"pipeline = {etp} x {ep} x {pp} = {etp * ep * pp}")
        self.validate_model(num_layers=num_layers, num_attention_heads=num_attention_heads,
                            num_query_groups=num_query_groups, vocab_size=vocab_size,
                            num_experts=num_experts, linear_num_key_heads=linear_num_key_heads)

    def check_context_parallel(self, *, transformer_engine: bool, cuda: bool, half: bool) -> None:
        """LayoutError unless context parallelism can run with this layer spec on this machine and
        parameter dtype (`half`: bf16/fp16): only Transformer Engine's attention (CUDA) exchanges
        keys and values between CP ranks, and only its flash/fused kernels, which take fp16/bf16,
        do so (TE's get_attention_backend filters fp32 out of those, and its unfused attention has
        no CP: "No dot product attention backend is available" at the first forward)."""
        if self.context > 1 and not (transformer_engine and cuda):
            raise LayoutError(f"parallel.context={self.context} needs the Transformer Engine layer "
                              "spec on CUDA: megatron's local attention does not support context "
                              "parallelism")
        if self.context > 1 and not half:
            raise LayoutError(f"parallel.context={self.context} needs model.dtype=bfloat16: "
                              "Transformer Engine's attention kernels with context parallelism take "
                              "16-bit inputs only")

    def validate_sizes(self) -> None:
        """The sizes themselves (>= 1; VPP needs PP), without a world size or a model."""
        for name in ("tensor", "pipeline", "expert", "context"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor is not None and self.expert_tensor < 1:
            raise LayoutError(f"parallel.expert_tensor must be >= 1, got {self.expert_tensor}")
        if self.virtual_pipeline is not None and self.virtual_pipeline < 1:
            raise LayoutError(f"parallel.virtual_pipeline must be >= 1, got {self.virtual_pipeline}")
        if self.vpp > 1 and self.pipeline == 1:
            raise LayoutError(f"virtual_pipeline={self.vpp} needs pipeline > 1, got pipeline=1")
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(self, name)
            if n is None:
                continue
            if n < 1:  # megatron: "num_layers_in_first_pipeline_stage must be larger than 0"
                raise LayoutError(f"parallel.{name} must be >= 1, got {n}")
            if self.pipeline == 1:
                raise LayoutError(f"{name}={n} needs pipeline > 1, got pipeline=1")
            if n % self.vpp:  # megatron: "... must be divisible by virtual pipeline parallel"
                raise LayoutError(f"{name}={n} is not divisible by virtual_pipeline {self.vpp} "
                                  "(every stage's layers split evenly over its virtual stages)")
        if (self.vpp > 1 and self.pipeline == 2 and self.first_stage_layers is not None
                and self.last_stage_layers is not None):
            # megatron-core (0.16-0.19) get_transformer_layer_offset divides by the number of
            # middle stages for every rank but the first: ZeroDivisionError while building.
            raise LayoutError(f"first_stage_layers={self.first_stage_layers} and last_stage_layers="
                              f"{self.last_stage_layers} with virtual_pipeline={self.vpp} need "
                              "pipeline > 2 (megatron-core's interleaved uneven split needs a "
                              "middle stage); set only one of them")

    def validate_layers(self, num_layers: int) -> None:
        """How num_layers split over the pipeline (and virtual) stages: megatron-core's rules
        (TransformerConfig.__post_init__, "Uneven PP"), checked here so that they fail before any
        collective, naming the numbers. Layers not on an uneven first/last stage split evenly over
        the middle stages, each stage and virtual stage gets at least one layer."""
        self.validate_sizes()
        pp, vpp = self.pipeline, self.vpp
        if not self.uneven:
            if num_layers % (pp * vpp):
                raise LayoutError(f"num_layers {num_layers} is not divisible by pipeline x "
                                  f"virtual_pipeline = {pp} x {vpp} = {pp * vpp}")
            return
        first, last = self.first_stage_layers, self.last_stage_layers
        ends = [f"{name} {n}" for name, n in (("first_stage_layers", first),
                                              ("last_stage_layers", last)) if n is not None]
        taken = " + ".join(ends) + (f" = {first + last} layers" if first is not None and last is not None else " layers")
        middle_stages = pp - len(ends)
        middle = num_layers - (first or 0) - (last or 0)
        if middle < 0:
            raise LayoutError(f"{taken} exceed num_layers {num_layers}")
        if middle == 0 and middle_stages:  # megatron: "Mismatch: 0 middle layers remaining ..."
            raise LayoutError(f"{taken} leave no layer of num_layers {num_layers} for the "
                              f"{middle_stages} middle stage(s) of pipeline {pp} (each stage needs "
                              "at least one layer)")
        if middle and not middle_stages:  # megatron: "Mismatch: N middle layers remaining ..."
            raise LayoutError(f"{taken} leave {middle} of num_layers {num_layers} but pipeline "
                              f"{pp} has no middle stage: the stages must add up to {num_layers}")
        if middle_stages and middle % (middle_stages * vpp):
            # megatron: "number of layers at middle stage ... must be divisible by the middle
            # pipeline model parallel size", then "... on each middle pipeline rank ... by virtual
            # pipeline parallel degree"
            raise LayoutError(f"num_layers {num_layers} - {' - '.join(ends)} = {middle} middle "
                              f"layers are not divisible by middle stages x virtual_pipeline = "
                              f"{middle_stages} x {vpp} = {middle_stages * vpp}")

    def validate_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                       vocab_size: int, num_experts: int | None = None,
                       linear_num_key_heads: int | None = None) -> None:
        """The checks that need the model's dimensions but not the world size
        (linear_num_key_heads: Qwen3-Next's Gated DeltaNet heads, split over TP ranks too)."""
        self.validate_layers(num_layers)
        tp, ep = self.tensor, self.expert
        if num_attention_heads % tp:
            raise LayoutError(f"num_attention_heads {num_attention_heads} is not divisible by "
                              f"tensor {tp}")
        if num_query_groups % tp:
            raise LayoutError(f"num_key_value_heads (query groups) {num_query_groups} is not "
                              f"divisible by tensor {tp}")
        if linear_num_key_heads and linear_num_key_heads % tp:
            raise LayoutError(f"linear_num_key_heads (Gated DeltaNet) {linear_num_key_heads} is not "
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
