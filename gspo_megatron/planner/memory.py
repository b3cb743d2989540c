"""Per-GPU memory of one training rank, from the model spec, the layout and the settings.

Every term is a formula with its source in megatron-core (0.16.1 line numbers; 0.19 the same
logic). Static terms (weights, gradients, optimizer state) are exact counts of what the built
model and optimizer hold (tests/planner/test_planner.py compares them with built models on gloo: TP2,
PP2, EP2, VPP2, DP2 with the distributed optimizer). Activations and the log-prob pass are
estimates, per token, to be checked against a GPU (`gspo-megatron plan --check`).

    mem = rank_memory(spec, layout, world, MemorySettings(max_tokens=16384))
    mem.total(), mem.static(), mem.max_tokens_that_fit(80 * 2**30)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.parallel.layout import ParallelLayout

if TYPE_CHECKING:  # the planner reads a torch-free ModelShape; plan --check a built ModelSpec
    from model_specs.build import ModelSpec
    from model_specs.shape import ModelShape

Model: TypeAlias = "ModelSpec | ModelShape"  # what the planner reads of a model: its config and sizes

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemorySettings:
    """What the memory depends on beyond the model and the layout (the run config's fields)."""

    params_dtype: str = "bfloat16"
    """model.dtype (float32, bfloat16; float16): weights and activations."""
    optimizer: str = "adam"
    """train.optimizer."""
    sgd_momentum: float = 0.0
    use_distributed_optimizer: bool = False
    """train.use_distributed_optimizer: optimizer state sharded over data parallel (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """train.grad_reduce_in_fp32."""
    optimizer_offload_fraction: float = 0.0
    """train.optimizer_cpu_offload's train.optimizer_offload_fraction (0: no offload): that share of
    the optimizer's parameters keeps its state on the host (host_bytes)."""
    max_tokens: int = 16384
    """Tokens one train micro-batch computes (train.max_tokens_per_micro_batch)."""
    num_microbatches: int = 8
    """Micro-batches per optimizer step on a rank (how many the pipeline keeps in flight)."""
    recompute: str = "none"
    """compute.recompute: none, selective, full."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """compute.recompute_modules with recompute=selective (megatron's default: core_attn)."""
    fused_log_probs: bool = True
    """logprob.fused: chunked log-probs, never the whole [tokens, vocab/TP] logits."""
    chunk_memory_mb: int = 1024
    """logprob.chunk_memory_mb: the fused path's chunk budget."""
    overhead_bytes: int = int(2.5 * GiB)
    """CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers and the allocator's slack; a
    calibration constant (measured per GPU by --check)."""
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    """The lora: section: with a rank > 0 the base is frozen (weights only) and the adapters
    alone have gradients and optimizer state (lora_params.py)."""

    def __post_init__(self) -> None:
        if self.params_dtype not in DTYPE_BYTES:
            raise ValueError(f"MemorySettings.params_dtype={self.params_dtype!r}: expected one of "
                             f"{sorted(DTYPE_BYTES)} (model.dtype's names)")

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank (the pipeline stage that needs the most)."""

    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    log_probs: int
    overhead: int
    activation_bytes_per_token: float
    """activations / max_tokens: what one more token of budget costs."""
    host: int = 0
    """Host memory the rank's offloaded optimizer holds (host_bytes)."""
    offloaded_params: int = 0
    """Parameters the host steps for this rank (optimizer offload)."""

    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer

    def total(self) -> int:
        return self.static() + self.activations + self.log_probs + self.overhead

    def max_tokens_that_fit(self, capacity: int) -> int:
        """The largest micro-batch token budget whose total fits in `capacity` bytes (multiple of
        1024; 0 when even the static memory does not fit). The log-prob pass is taken at its
        value for this budget (flat with fused log-probs)."""
        room = capacity - self.static() - self.overhead - self.log_probs
        if room <= 0 or self.activation_bytes_per_token <= 0:
            return 0
        return int(room // self.activation_bytes_per_token) // 1024 * 1024


# --- parameters ---------------------------------------------------------------------------------
def _is_moe_layer(c, i: int) -> bool:
    """megatron's moe_layer_freq (transformer_block / moe_utils get_moe_layer_pattern)."""
    if not c.num_moe_experts:
        return False
    freq = c.moe_layer_freq
    return (i % freq == 0) if isinstance(freq, int) else bool(freq[i])


def _mlp(c, ffn: int) -> int:
    """fc1 (gated: [2 x ffn, h]) + fc2 ([h, ffn]); with add_bias_linear (gpt-oss) their biases,
    [2 x ffn] and [h] (an expert's, as its weights, split by ETP: fc2's is whole, but ETP = 1
    there: model_specs/features/linear_bias/)."""
    gated = 2 if c.gated_linear_unit else 1
    bias = gated * ffn + c.hidden_size if c.add_bias_linear else 0
    return (gated + 1) * c.hidden_size * ffn + bias


def layer_params(c, i: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer i on one rank.

    attention: attention_params; input and pre-MLP RMSNorm [h] each
    (replicated; TE fuses them into the next linear's layer_norm_weight, the same count).
    MoE (moe_layer.py): router [E, h] (+ bias [E] with add_bias_linear) replicated (the expert
    bias is a buffer, megatron-core TopKRouter.__init__);
    E / EP local experts of fc1 + fc2 split by ETP; a shared expert split by TP, its gate [1, h].
    Dense MLP split by TP.
    """
    h = c.hidden_size
    dense = attention_params(c, tp) + 2 * h
    expert = 0
    if _is_moe_layer(c, i):
        dense += c.num_moe_experts * (h + 1 if c.add_bias_linear else h)
        if c.moe_shared_expert_intermediate_size:
            dense += _mlp(c, c.moe_shared_expert_intermediate_size) // tp
            dense += h if c.moe_shared_expert_gate else 0
        expert = c.num_moe_experts // ep * _mlp(c, c.moe_ffn_hidden_size) // etp
    else:
        dense += _mlp(c, c.ffn_hidden_size) // tp
    return dense, expert


def attention_params(c, tp: int) -> int:
    """One rank's attention weights. GQA: linear_qkv [(q + 2 kv) / TP, h] (+ bias), linear_proj
    [h, q / TP] (+ bias [h] with add_bias_linear), q/k layernorm [head_dim] each, sinks [heads /
    TP] (gpt-oss: model_specs/features/sinks/). Multi-latent attention (model_specs/features/
    mla/): the down-projections [q_lora, h] and [kv_lora + rope, h] and the latents' norms whole on
    every rank (in both specs), the up-projections (or q_proj) and linear_proj split by heads."""
    h, n = c.hidden_size, c.num_attention_heads
    if c.multi_latent_attention:
        q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
        q = h * n * q_head // tp if c.q_lora_rank is None else \
            h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * q_head // tp
        kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank
        kv += c.kv_lora_rank * n * (c.qk_head_dim + c.v_head_dim) // tp
        return q + kv + n * c.v_head_dim * h // tp
    d = c.kv_channels
    q, kv = n * d, (c.num_query_groups or n) * d
    out = h * (q + 2 * kv) // tp + q * h // tp
    out += (q + 2 * kv) // tp if c.add_qkv_bias else 0
    out += h if c.add_bias_linear else 0
    out += n // tp if c.softmax_type == "learnable" else 0
    return out + (2 * d if c.qk_layernorm else 0)


def head_width(c) -> float:
    """The width one attention head multiplies per pair of tokens, averaged over q.k and
    scores.v (the attention's FLOPs): head_dim, or MLA's (nope + rope + v) / 2."""
    if c.multi_latent_attention:
        return (c.qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim) / 2
    return c.kv_channels


def stage_params(spec: Model, layout: ParallelLayout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters one rank of pipeline stage `pp_rank` holds, all its virtual
    stages: its layers, the embedding on the first stage (vocab / TP x h), the output layer (unless
    tied with PP1: megatron keeps a copy on the last stage when PP > 1, gpt_model.py) and the
    final norm on the last."""
    c, tp = spec.config, layout.tensor
    dense = expert = 0
    for row in layout.virtual_stage_layers(c.num_layers):
        for i in row[pp_rank]:
            d, e = layer_params(c, i, tp, layout.expert, layout.etp)
            dense, expert = dense + d, expert + e
    table = spec.vocab_size // tp * c.hidden_size
    first, last = pp_rank == 0, pp_rank == layout.pipeline - 1
    dense += table if first else 0
    if last:
        tied_here = spec.share_embeddings_and_output_weights and layout.pipeline == 1
        dense += c.hidden_size + (0 if tied_here else table)
    return dense, expert


# --- static bytes ---------------------------------------------------------------------------------
def _optimizer_bytes_per_param(s: MemorySettings) -> int:
    """Adam: exp_avg + exp_avg_sq in fp32, plus an fp32 main copy of 16-bit weights
    (optimizer/optimizer.py Float16OptimizerWithFloat16Params; distrib_optimizer.py
    shard_fp32_from_float16_groups). SGD: a momentum buffer when momentum > 0."""
    main = 4 if s.params_dtype != "float32" else 0
    if s.optimizer == "adam":
        return 8 + main
    return (4 if s.sgd_momentum else 0) + main


def static_bytes(spec: Model, layout: ParallelLayout, world: int, s: MemorySettings,
                 pp_rank: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state on the GPU) bytes of a rank of stage `pp_rank`; with
    optimizer offload the offloaded share's state is on the host instead (offloaded_params).

    Gradients: DDP's contiguous grad buffer, fp32 with grad_reduce_in_fp32 or fp32 weights
    (distributed/param_and_grad_buffer.py), one per parameter. The distributed optimizer keeps
    state for its shard only: dense parameters over data parallel x context parallel
    (intra_dp_cp group), experts over the expert-data-parallel group (world / (ETP x EP x PP)).
    """
    dense, expert = stage_params(spec, layout, pp_rank)
    p_bytes = s.param_bytes
    g_bytes = 4 if (s.grad_reduce_in_fp32 or s.params_dtype == "float32") else p_bytes
    weights = (dense + expert) * p_bytes
    if s.lora.enabled:  # the base frozen: weights only; the adapters train
        dense, expert = stage_adapter_params(spec, layout, pp_rank, s.lora)
        weights += (dense + expert) * p_bytes
    optimizer = _optimizer_bytes_per_param(s) * optimizer_params(dense, expert, layout, world, s)
    return weights, (dense + expert) * g_bytes, int(optimizer * (1 - s.optimizer_offload_fraction))


def stage_adapter_params(spec: Model, layout: ParallelLayout, pp_rank: int, lora: LoraSettings) -> tuple[int, int]:
    """(dense, expert) LoRA adapter parameters one rank of stage `pp_rank` holds (lora_params.py)."""
    from gspo_megatron.planner.lora_params import layer_adapter_params
    dense = expert = 0
    for row in layout.virtual_stage_layers(spec.config.num_layers):
        for i in row[pp_rank]:
            d, e = layer_adapter_params(spec.config, i, layout.tensor, layout.expert, lora)
            dense, expert = dense + d, expert + e
    return dense, expert


def optimizer_params(dense: int, expert: int, layout: ParallelLayout, world: int, s: MemorySettings) -> int:
    """The parameters whose optimizer state a rank holds: its shard with the distributed optimizer,
    dense parameters over data parallel x context parallel (intra_dp_cp group), experts over the
    expert-data-parallel group (world / (ETP x EP x PP)); else all of its own."""
    if not s.use_distributed_optimizer:
        return dense + expert
    dp_cp = world // (layout.tensor * layout.pipeline)
    edp = world // (layout.etp * layout.expert * layout.pipeline)
    return -(-dense // dp_cp) + -(-expert // edp)


# Host bytes per offloaded parameter: its fp32 main weight, Adam's exp_avg and exp_avg_sq (fp32),
# and the fp32 copy of its gradient the GPU sends down each step (megatron-core
# optimizer/cpu_offloading/hybrid_optimizer.py: param_update_in_fp32, cpu_copy_map_grad).
HOST_BYTES_PER_OFFLOADED_PARAM = 16


def offloaded_params(spec: Model, layout: ParallelLayout, world: int, s: MemorySettings, pp_rank: int) -> int:
    """Parameters of a rank of stage `pp_rank` the host steps (optimizer offload), 0 without."""
    if not s.optimizer_offload_fraction:
        return 0
    dense, expert = (stage_adapter_params(spec, layout, pp_rank, s.lora) if s.lora.enabled
                     else stage_params(spec, layout, pp_rank))
    return int(optimizer_params(dense, expert, layout, world, s) * s.optimizer_offload_fraction)


# --- activations ----------------------------------------------------------------------------------
def layer_activation_bytes(spec: Model, layout: ParallelLayout, s: MemorySettings, i: int) -> float:
    """Bytes layer i keeps for backward per token of a micro-batch, on one rank (estimate).

    From Korthikanti et al. 2022 ("Reducing activation recomputation", table 2) with flash
    attention (TE's fused attention keeps q, k, v, its output and a per-head fp32 log-sum-exp; no
    [s, s] scores). With sequence parallelism the layer-norm inputs and outputs are split over TP
    (megatron's linears keep their SP-split input and gather it again in backward,
    tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication). MoE: every token
    goes to top-k experts; the alltoall dispatcher spreads the k copies of a rank's tokens over the
    EP ranks, so on average a rank's experts keep k copies of its own token count: the permuted
    input [h], fc1's output [2 x ffn] (gated), the activation's [ffn], fc2's output [h].
    Recomputation (transformer_layer.py, moe/experts.py): "layernorm" drops the norm outputs,
    "moe_act" the activation's output, "core_attn" the log-sum-exp, "moe"/"mlp" keep only the
    block's input, "full" keeps only the layer's input.
    """
    c, tp = spec.config, layout.tensor
    b = s.param_bytes
    h = c.hidden_size
    sp = tp if layout.use_sequence_parallel(spec.is_moe) else 1
    if s.recompute == "full":
        return b * h / sp
    mods = set(s.recompute_modules) if s.recompute == "selective" else set()
    norm_out = 0 if "layernorm" in mods else b * h / sp
    attn = b * h / sp + norm_out + _attention_activations(c, b, tp, sp)
    attn += 0 if "core_attn" in mods else 4 * c.num_attention_heads / tp
    if _is_moe_layer(c, i):
        if "moe" in mods:
            return attn + b * h / sp
        ffn, k, experts = c.moe_ffn_hidden_size, c.moe_router_topk, c.num_moe_experts
        if ffn is None or experts is None:
            raise ValueError(f"layer {i} is a MoE layer of a config without moe_ffn_hidden_size or num_moe_experts")
        gate = 2 if c.gated_linear_unit else 1
        per_copy = b * (2 * h + gate * ffn + (0 if "moe_act" in mods else ffn))
        mlp = b * h / sp + norm_out + 8 * experts / sp + k * per_copy / sp
        if c.moe_shared_expert_intermediate_size:
            sh = c.moe_shared_expert_intermediate_size
            mlp += b * (gate * sh + sh) / tp
        return attn + mlp
    if "mlp" in mods:
        return attn + b * h / sp
    gate = 2 if c.gated_linear_unit else 1
    return attn + b * h / sp + norm_out + b * (gate + 1) * c.ffn_hidden_size / tp


def _attention_activations(c, b: int, tp: int, sp: int) -> float:
    """Per token: q, k, v and the attention's output (GQA: [q + 2 kv] + [q], over TP).
    Multi-latent attention (multi_latent_attention.py, get_query_key_value_tensors) also keeps
    its latents: q's [q_lora] and its norm's output, the kv latent [kv_lora + rope] and its norm's
    output (sequence-parallel like the hidden state), the shared rope key gathered [rope]; then q
    and k of nope + rope channels per head (k's rope part copied to every head), v and the output
    of v channels per head."""
    n = c.num_attention_heads
    if c.multi_latent_attention:
        q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
        latents = 2 * (c.q_lora_rank or 0) + 2 * c.kv_lora_rank + c.qk_pos_emb_head_dim
        return b * latents / sp + b * c.qk_pos_emb_head_dim + b * n * (2 * q_head + 2 * c.v_head_dim) / tp
    d = c.kv_channels
    q, kv = n * d, (c.num_query_groups or n) * d
    return b * (q + 2 * kv) / tp + b * q / tp


def in_flight(layout: ParallelLayout, pp_rank: int, num_microbatches: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of all its layers.
    1F1B (schedules.py forward_backward_pipelining_without_interleaving): num_warmup =
    PP - rank - 1, plus the one in flight. Interleaved: (PP - rank - 1) x 2 + (VPP - 1) x PP
    warm-up chunks + 1, each 1/VPP of the stage's layers."""
    pp, vpp, m = layout.pipeline, layout.vpp, num_microbatches
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - pp_rank, m))
    chunks = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
    return chunks / vpp


def log_prob_bytes(spec: Model, layout: ParallelLayout, s: MemorySettings) -> float:
    """The last stage's output layer and log-probs for one micro-batch (logprobs.py): fused, one
    chunk of [chunk, vocab / TP] fp32 logits and their exp (default_chunk_tokens keeps those in
    chunk_memory_mb) plus per-token scalars; straightforward, the [tokens, vocab / TP] logits in
    the model's dtype, their fp32 copy and the log-softmax."""
    tokens = s.max_tokens / layout.context
    v = spec.vocab_size / layout.tensor
    b = s.param_bytes
    if s.fused_log_probs:
        return min(s.chunk_memory_mb * 2**20, tokens * v * 8) + 16 * tokens
    return tokens * v * (b + 8)


def stage_memory(spec: Model, layout: ParallelLayout, world: int, s: MemorySettings, r: int) -> RankMemory:
    """The memory of a rank of pipeline stage r (see the module docstring)."""
    weights, grads, opt = static_bytes(spec, layout, world, s, r)
    layers = [i for row in layout.virtual_stage_layers(spec.config.num_layers) for i in row[r]]
    per_token = sum(layer_activation_bytes(spec, layout, s, i) for i in layers)
    per_token *= in_flight(layout, r, s.num_microbatches) / layout.context
    # The layer in backward: its activations recomputed (full/selective) and their gradients, for
    # one micro-batch (the size of one layer's activations kept without recomputation).
    plain = dataclasses.replace(s, recompute="none")
    per_token += max(layer_activation_bytes(spec, layout, plain, i) for i in layers) / layout.context
    per_token += spec.config.hidden_size * 4 / layout.context  # the stage's input/output hidden
    logp = int(log_prob_bytes(spec, layout, s)) if r == layout.pipeline - 1 else 0
    off = offloaded_params(spec, layout, world, s, r)
    return RankMemory(stage=r, weights=weights, gradients=grads, optimizer=opt,
                      activations=int(per_token * s.max_tokens), log_probs=logp,
                      overhead=s.overhead_bytes, activation_bytes_per_token=per_token,
                      host=off * HOST_BYTES_PER_OFFLOADED_PARAM, offloaded_params=off)


def rank_memory(spec: Model, layout: ParallelLayout, world: int, s: MemorySettings) -> RankMemory:
    """The memory of the pipeline stage that needs the most."""
    return max((stage_memory(spec, layout, world, s, r) for r in range(layout.pipeline)),
               key=lambda m: m.total())


def with_tokens(s: MemorySettings, max_tokens: int) -> MemorySettings:
    return dataclasses.replace(s, max_tokens=max_tokens)
