"""Build the megatron-core model for a parallel layout: model chunks, DDP, optimizer, scheduler.

    spec = spec_for_layout(hf_config, layout)           # model_specs + the layout's fields
    check_layout(spec, layout, world_size)            # before any collective
    init_process_groups(layout)
    chunks = build_model_chunks(spec, layout)         # one DDP-wrapped GPTModel per virtual stage
    optimizer, scheduler = build_optimizer(chunks, OptimizerSettings(lr=1e-6))

The model definition comes from model_specs (a ModelSpec); this module only applies the layout
(torchtitan's "build, then parallelise"). The schedule hooks that megatron's own training loop
sets on the TransformerConfig (finalize_model_grads_func: DP grad all-reduce / reduce-scatter,
sequence-parallel norm grads, tied embeddings; no_sync_func; grad_scale_func) are set here too:
without finalize_model_grads_func the schedule never synchronises gradients across DP ranks.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from gspo_megatron.actor.settings import Available, ComputeSettings, OptimizerSettings
from gspo_megatron.actor.weights.full import mark_expert_params
from gspo_megatron.lora.attach import attach_lora
from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.parallel.model_chunks import unwrap
from model_specs import ModelSpec, load_hf_config, model_dims_for, model_spec_for


def spec_for_layout(model: str | Path | Mapping[str, Any], layout: ParallelLayout, *,
                    params_dtype: torch.dtype = torch.float32,
                    overrides: Mapping[str, Any] | None = None,
                    compute: ComputeSettings | None = None,
                    available: Available | None = None) -> ModelSpec:
    """model_specs' ModelSpec of an HF model (dict, config.json or directory) for `layout`.

    The layout is checked against the model's dimensions first (LayoutError naming the numbers;
    the world size is checked later, by check_layout, with the real one; context parallelism
    without the TE spec on CUDA is refused here). The layout's
    TransformerConfig fields, the CPU adaptations when CUDA is absent, the compute settings
    (resolved against this machine: TE spec, grouped GEMM, fusions, recomputation), then
    `overrides` are handed to model_specs, which knows nothing of layouts or machines.
    available: what this machine has (None: detect it).
    """
    hf = load_hf_config(model)
    dims = model_dims_for(hf)
    layout.validate_model(**dims)
    available = available or Available.detect()
    compute = (compute or ComputeSettings()).resolve(available)
    layout.check_context_parallel(transformer_engine=bool(compute.transformer_engine), cuda=available.cuda,  # resolved
                                  half=params_dtype in (torch.bfloat16, torch.float16))
    fields = layout.transformer_config_fields(is_moe=bool(dims["num_experts"]))
    if not torch.cuda.is_available():
        fields.update(cpu_config_overrides(layout.vpp))
    fields.update(compute.transformer_config_fields())
    fields.update(overrides or {})
    return model_spec_for(hf, params_dtype=params_dtype, overrides=fields,
                          transformer_engine=compute.transformer_engine)


def check_layout(spec: ModelSpec, layout: ParallelLayout, world_size: int) -> None:
    """LayoutError (naming the numbers) if `layout` cannot run `spec` on `world_size` ranks.

    Call it with the real world size before init_process_groups: a layout that does not fit shows
    up otherwise as a hang in the first collective.
    """
    c = spec.config
    layout.validate(world_size, num_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                    num_query_groups=c.num_query_groups or c.num_attention_heads,
                    vocab_size=spec.vocab_size, num_experts=c.num_moe_experts,
                    linear_num_key_heads=(c.linear_num_key_heads if c.experimental_attention_variant
                                          == "gated_delta_net" else None))


def _check_config_matches_layout(spec: ModelSpec, layout: ParallelLayout) -> None:
    c = spec.config
    want = dict(tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
                expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.etp,
                virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
                context_parallel_size=layout.context,
                # Which layers each (virtual) stage builds, hence their global names, follow these.
                num_layers_in_first_pipeline_stage=layout.first_stage_layers,
                num_layers_in_last_pipeline_stage=layout.last_stage_layers)
    got = {k: getattr(c, k) for k in want}
    if got != want:
        raise ValueError(f"ModelSpec was built for another layout: config has {got}, layout {layout} "
                         f"needs {want}; build the spec with spec_for_layout(hf_config, layout)")
    if c.calculate_per_token_loss:
        raise ValueError("TransformerConfig.calculate_per_token_loss=True is not supported: the "
                         "actor scales the loss itself (see actor/steps.py)")


@contextlib.contextmanager
def _native_linears_buildable_without_apex(needed: bool) -> Iterator[None]:
    """While `needed`: megatron's ColumnParallelLinear builds with gradient_accumulation_fusion=True
    although apex's fused_weight_gradient_mlp_cuda is missing. Its constructor refuses that
    (megatron-core tensor_parallel/layers.py ColumnParallelLinear.__init__, module flag
    `_grad_accum_fusion_available`, set at import), which made every TE-spec model crash on a GPU
    without apex: the output layer is megatron's own ColumnParallelLinear in either spec.
    `unfuse_native_linears` turns the fusion off on those layers right after the build, so the
    extension is never called."""
    from megatron.core.tensor_parallel import layers
    if not hasattr(layers, "_grad_accum_fusion_available"):
        raise RuntimeError("megatron-core moved tensor_parallel.layers._grad_accum_fusion_available: "
                           "update actor/build.py (gradient accumulation fusion without apex)")
    saved = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = saved or needed
    try:
        yield
    finally:
        layers._grad_accum_fusion_available = saved


def unfuse_native_linears(model: torch.nn.Module) -> list[str]:
    """Turn gradient_accumulation_fusion off on megatron's own Column/RowParallelLinear layers of
    `model` (they need apex's extension; Transformer Engine's layers accumulate into main_grad
    themselves and keep it); returns their names. DDP's backward hook adds a layer's `.grad` into
    `main_grad` per parameter unless the GEMM already did (`grad_added_to_main_grad`,
    DistributedDataParallel._make_backward_post_hook), so fused TE layers and unfused native ones
    mix in one model."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)) \
                and m.gradient_accumulation_fusion:
            m.gradient_accumulation_fusion = False
            names.append(name)
    return names


def build_gpt_model(spec: ModelSpec, vp_stage: int | None, *, apex_wgrad: bool) -> GPTModel:
    """The GPTModel of one (virtual) pipeline stage of this rank, on the CPU (the caller moves it).

    With config.gradient_accumulation_fusion on and apex's fused_weight_gradient_mlp_cuda missing
    (`apex_wgrad` False: the usual GPU node, apex is not on PyPI), Transformer Engine's layers fuse
    the weight-gradient accumulation and megatron's own linears (the output layer; every linear of
    the local spec) accumulate unfused."""
    without_apex = bool(spec.config.gradient_accumulation_fusion) and not apex_wgrad
    with _native_linears_buildable_without_apex(without_apex):
        model = GPTModel(
            spec.config, spec.block_spec(vp_stage),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, **spec.gpt_model_kwargs())
    if without_apex:
        unfuse_native_linears(model)
    return model


def build_model_chunks(spec: ModelSpec, layout: ParallelLayout, *,
                       use_distributed_optimizer: bool = False,
                       grad_reduce_in_fp32: bool = True,
                       apex_wgrad: bool | None = None,
                       lora: LoraSettings | None = None, lora_seed: int = 0) -> list[DistributedDataParallel]:
    """One DDP-wrapped GPTModel per virtual pipeline stage of this rank (a list of 1 without VPP).

    Needs megatron's parallel state (init_process_groups(layout)). Parameters are initialised by
    megatron's init methods from the seeded RNG; load real weights with weights.load_full_state_dict.
    apex_wgrad: apex's fused_weight_gradient_mlp_cuda is installed (None: detect; build_gpt_model).
    lora: with a rank > 0, the base is frozen and adapters attached (gspo_megatron/lora/attach.py)
    before the DDP wrap, so that DDP's buffers and the optimizer hold the adapters only; their A
    is drawn from `lora_seed`.
    """
    _check_config_matches_layout(spec, layout)
    config = spec.config
    if apex_wgrad is None:
        apex_wgrad = Available.detect().apex_wgrad
    vpp = layout.vpp
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        model = build_gpt_model(spec, vp_stage, apex_wgrad=apex_wgrad)
        model.model_type = ModelType.encoder_or_decoder
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        mark_expert_params(model)
        if lora is not None and lora.enabled:
            attach_lora(model, lora, seed=lora_seed)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if config.fp16 or config.bf16:
            model = Float16Module(config, model)
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32 or not (config.fp16 or config.bf16),
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        # Gradients are pre-scaled by 1/dp_size and summed (the default). train.py's loss scaling
        # assumes exactly a 1/dp_size factor, which average_in_collective=True gives too.
        average_in_collective=False,
    )
    chunks = [DistributedDataParallel(config, ddp_config, m,
                                      # Only the first chunk's buckets may be overlapped/flagged.
                                      disable_bucketing=i > 0)
              for i, m in enumerate(chunks)]
    for chunk in chunks:
        chunk.broadcast_params()  # identical replicas across DP (init is seeded, this makes it sure)
    if layout.vpp > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
        # Both faults are gloo's pairing of batched p2p messages when the previous and next
        # stage are one rank (docs/cpu.md #10); cpu_compat.cpu_config_overrides explains them.
        for field in ("batch_p2p_comm", "variable_seq_lengths"):
            if getattr(config, field):
                raise ValueError(f"an interleaved pipeline on gloo needs {field}=False (with True "
                                 "the run is silently wrong or crashes); model_specs sets it "
                                 "through cpu_config_overrides")
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    return chunks


def build_optimizer(chunks: list[DistributedDataParallel], settings: OptimizerSettings,
                    ) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron optimizer (distributed if settings say so; must match the DDP config) + scheduler."""
    config = unwrap(chunks[0]).config
    if settings.use_distributed_optimizer != chunks[0].ddp_config.use_distributed_optimizer:
        raise ValueError(f"use_distributed_optimizer={settings.use_distributed_optimizer} but the "
                         f"model chunks were built with "
                         f"{chunks[0].ddp_config.use_distributed_optimizer}")
    offload = {}
    if settings.optimizer_cpu_offload:
        if not torch.cuda.is_available():
            raise ValueError("train.optimizer_cpu_offload: true needs CUDA GPUs (megatron's "
                             "HybridDeviceOptimizer copies gradients to the host and weights back on "
                             "CUDA streams); on a CPU everything is on the host already: set it false")
        # as megatron's --optimizer-cpu-offload --use-precision-aware-optimizer
        # --overlap-cpu-optimizer-d2h-h2d (optimizer_config.py: the precision-aware optimizer with
        # offload skips TE's FusedAdam check; optimizer/__init__.py builds HybridDeviceOptimizer)
        offload = dict(optimizer_cpu_offload=True,
                       optimizer_offload_fraction=settings.optimizer_offload_fraction,
                       use_precision_aware_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True)
    opt_config = OptimizerConfig(
        optimizer=settings.optimizer, lr=settings.lr, min_lr=settings.min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        sgd_momentum=settings.sgd_momentum, clip_grad=settings.clip_grad,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16, **offload,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if settings.lr_warmup_steps else settings.lr, max_lr=settings.lr,
        min_lr=settings.min_lr, lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=max(settings.decay_steps(), settings.lr_warmup_steps + 1),
        lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay,
        end_wd=settings.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
    return optimizer, scheduler
