"""The actor's settings: plain dataclasses, no torch, one docstring per field.

The run config uses them as its sections (config.py: `train:` is an OptimizerSettings, `loss:` a
LossSettings), so a field is declared once and documented once; the actor can also be built
without a run config (tests, benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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
    optimizer_cpu_offload: bool = False
    """Keep Adam's state and fp32 main weights (this fraction of them: optimizer_offload_fraction)
    in host memory and step them on the CPU: megatron's HybridDeviceOptimizer, with the
    precision-aware optimizer, gradients copied to the host and weights back on side streams
    (overlap_cpu_optimizer_d2h_h2d). What a model of DeepSeek-V3's size needs on 128 H100s
    (`gspo-megatron plan`). CUDA only (the optimizer moves state between a GPU and its host); needs
    use_distributed_optimizer."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the share of the optimizer's parameters stepped on the host."""

    def __post_init__(self) -> None:
        # Errors read "field=value: expected ..." so that the config can prefix its section.
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.use_distributed_optimizer and self.optimizer != "adam":
            # megatron-core's DistributedOptimizer asserts Adam (checkpointing requirements).
            raise ValueError(f"use_distributed_optimizer=True needs optimizer='adam', got "
                             f"{self.optimizer!r}")
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            # megatron-core builds HybridDeviceOptimizer only inside the distributed optimizer
            # (optimizer/__init__.py; the precision-aware optimizer asserts it, optimizer_config.py)
            raise ValueError("optimizer_cpu_offload=True needs use_distributed_optimizer=True")
        if not 0.0 < self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction={self.optimizer_offload_fraction!r}: "
                             "expected a fraction in (0, 1]")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps!r}: expected >= 1 or null")

    def decay_steps(self) -> int:
        """Steps of the learning-rate decay (the run config counts the run's optimizer steps)."""
        return self.lr_decay_steps or 1

    def check_machine(self, available: "Available") -> None:
        """ValueError ("field=value: ...") for a setting this machine cannot run, at start: not as
        megatron's traceback once the optimizer is built (actor/build.py build_optimizer)."""
        if self.optimizer_cpu_offload and not available.cuda:
            raise ValueError("optimizer_cpu_offload=True needs CUDA GPUs (megatron's HybridDeviceOptimizer "
                             "copies gradients to the host and weights back on CUDA streams); on a CPU "
                             "the optimizer's state is on the host already: set it false")


@dataclass
class MicroBatchSettings:
    """How a rank's rows are grouped into micro-batches (actor/batching/token_budget.py)."""

    micro_batch_size: int = 8
    """Sequences per forward/backward micro-batch on one data-parallel rank, at most."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a train micro-batch: the tokens it computes (rows x longest row, padding
    included; packed: the rows' lengths summed) stay within it; null = micro_batch_size alone
    decides. Rows are grouped longest first; a row longer than the budget is a micro-batch of
    its own. The budget counts whole rows: under context parallelism each CP rank computes
    1/parallel.context of them, so a budget sized for one rank's memory can be context times
    larger."""
    max_tokens_per_forward_micro_batch: int | None = None
    """The same for the forward-only passes (old and reference log-probs keep no activations for
    backward, so a larger budget fits); null = max_tokens_per_micro_batch."""
    longest_first: bool = True
    """Group rows longest first (rows of similar length share a micro-batch: little padding);
    false: in rollout order, split into equal row counts (the project's layout before token
    budgets, kept for comparisons)."""
    pack_sequences: bool | None = None
    """Concatenate a micro-batch's rows into one sequence without padding (megatron's THD layout,
    cu_seqlens; RoPE positions restart per row). Needs Transformer Engine's attention (CUDA); null =
    whenever the TE spec runs on CUDA. Unpacked micro-batches are built from length-sorted rows."""
    dp_balance: str = "flops"
    """How each mini-batch's rows are shared among the data-parallel ranks (actor/batching/balance.py):
    flops (Karmarkar-Karp on each row's estimated FLOPs, attention's quadratic term included),
    tokens (on its real tokens) or rows (consecutive blocks of equal row counts: one rank may get
    every long response). Any choice trains the same loss and gradients."""

    def __post_init__(self) -> None:
        from gspo_megatron.actor.batching.balance import BALANCE_MODES
        if self.dp_balance not in BALANCE_MODES:
            raise ValueError(f"dp_balance={self.dp_balance!r}: expected one of {BALANCE_MODES}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size!r}: expected >= 1")
        for name in ("max_tokens_per_micro_batch", "max_tokens_per_forward_micro_batch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v!r}: expected >= 1 or null")

    def max_tokens(self, forward_only: bool) -> int | None:
        if forward_only and self.max_tokens_per_forward_micro_batch is not None:
            return self.max_tokens_per_forward_micro_batch
        return self.max_tokens_per_micro_batch


@dataclass
class RoutingSettings:
    """MoE routing tools of the actor (actor/router_control.py; docs/moe_stability.md)."""

    replay: bool = False
    """Routing replay ("R3"): megatron's routers use the experts SGLang routed each token to, in
    the old-log-prob pass, the KL reference pass and the train steps. The gating weights are still
    computed by the current router at those experts, so the router keeps learning (as slime, verl
    and megatron's RouterReplay do). Turns on engine_routing."""
    drift: bool | None = None
    """Routing drift, every step: the fraction of (token, layer) top-k expert sets on trained
    tokens that differ between pi_old (the old-log-prob pass) and the policy after the step's
    updates, measured by one extra forward-only pass (GSPO paper §5.3: ~10% on a 48-layer MoE).
    null = on for MoE models with train.old_log_probs=recompute (and parallel.context=1)."""
    engine_routing: bool | None = None
    """Ask SGLang for the experts it routed every token to (--enable-return-routed-experts) and
    report routing_engine_mismatch: the fraction of those sets megatron's routers choose
    differently in the old-log-prob pass (same weights unless rollouts lag). null = with replay."""

    def resolve(self, *, is_moe: bool, recompute: bool, context_parallel: int = 1) -> "RoutingSettings":
        """The settings with nulls decided; errors name what cannot run. Under context parallelism
        (routers see zig-zag chunks of the rows, which router_control.py does not map) all are off."""
        if (self.replay or self.drift or self.engine_routing) and not is_moe:
            raise ValueError("moe.replay / moe.drift / moe.engine_routing: the model has no MoE layers")
        if (self.replay or self.drift or self.engine_routing) and context_parallel > 1:
            raise ValueError("moe.replay / moe.drift / moe.engine_routing are not supported with "
                             f"parallel.context={context_parallel}")
        recompute = recompute and context_parallel == 1  # drift's null: off under CP
        if self.drift and not recompute:
            raise ValueError("moe.drift=true needs train.old_log_probs=recompute (pi_old's routing "
                             "is recorded in that pass)")
        if self.engine_routing is False and self.replay:
            raise ValueError("moe.replay=true needs the engine's routing: engine_routing must not be false")
        return RoutingSettings(replay=self.replay,
                               drift=is_moe and recompute if self.drift is None else self.drift,
                               engine_routing=self.replay if self.engine_routing is None else self.engine_routing)


@dataclass
class LogProbSettings:
    """How the last stage computes per-token log-probs."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts: log-probs are of softmax(logits / temperature)."""
    fused: bool = True
    """Compute log-probs from hidden states + output weight in token chunks (no full logits)."""
    chunk_tokens: int | None = None
    """Tokens per chunk of the fused path; None: as many as fit in chunk_memory_mb."""
    chunk_memory_mb: int = 1024
    """Memory for one chunk's fp32 logits (and their exp) when chunk_tokens is None: at vocab 152k
    and TP1 about 880 tokens per chunk, at TP8 about 7000."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: expected > 0")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens!r}: expected >= 1")
        if self.chunk_memory_mb < 1:
            raise ValueError(f"chunk_memory_mb={self.chunk_memory_mb!r}: expected >= 1")


@dataclass(frozen=True)
class Available:
    """What this machine can run (detected once at start; tests pass their own)."""
    cuda: bool
    transformer_engine: bool
    apex_wgrad: bool  # apex's fused_weight_gradient_mlp_cuda extension
    te_version: str | None = None  # transformer_engine.__version__ where it imports
    gpu_name: str = ""  # this rank's GPU, with CUDA
    gpu_capability: tuple[int, int] | None = None  # its compute capability, with CUDA
    triton_version: str | None = None  # the installed Triton's, with CUDA
    fla_tilelang: bool = False  # flash-linear-attention's TileLang backend would run (kernels.py)

    @staticmethod
    def detect() -> "Available":
        import importlib.util
        import os

        import torch

        from model_specs.features.gated_delta_net.kernels import tilelang_usable, triton_version
        from model_specs.norms import HAVE_TE
        te_version = None
        if HAVE_TE:
            import transformer_engine
            te_version = transformer_engine.__version__
        cuda = torch.cuda.is_available()
        gpu: dict = {}
        if cuda:  # this rank's own device (torchrun's LOCAL_RANK): no context on another one
            index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            major, minor = torch.cuda.get_device_capability(index)
            gpu = dict(gpu_name=torch.cuda.get_device_name(index), gpu_capability=(major, minor),
                       triton_version=triton_version(), fla_tilelang=tilelang_usable())
        return Available(cuda=cuda, transformer_engine=HAVE_TE,
                         apex_wgrad=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
                         te_version=te_version, **gpu)

    def check_gated_delta_net(self) -> None:
        """For a model with Gated DeltaNet layers: DeltaRuleKernelError, naming the Triton version,
        the GPU and what to install, where flash-linear-attention's backward would refuse (or be
        wrong) on this machine (model_specs/features/gated_delta_net/kernels.py). A no-op
        without CUDA (the CPU takes the torch forms)."""
        if self.cuda:
            from model_specs.features.gated_delta_net.kernels import check_backward_kernels
            check_backward_kernels(triton=self.triton_version, capability=self.gpu_capability,
                                   device=self.gpu_name, tilelang=self.fla_tilelang)


@dataclass(frozen=True)
class ComputeSettings:
    """How the model runs on this machine: layer implementation, fused kernels, recomputation.
    Each null follows what the machine has: with CUDA and Transformer Engine the TE layer spec,
    grouped-GEMM experts and the fusions are on; on a CPU all of them are off."""

    transformer_engine: bool | None = None
    """Build the layers with Transformer Engine's spec (null: when TE imports, which needs CUDA and
    cuDNN); false: megatron's local spec. Checkpoints load under either."""
    moe_grouped_gemm: bool | None = None
    """All local experts of a layer in one grouped GEMM (TE's GroupedLinear) instead of one GEMM per
    expert (null: with TE)."""
    moe_permute_fusion: bool | None = None
    """Fused token permute / unpermute in the MoE dispatcher (TE >= 2.1; null: with TE)."""
    apply_rope_fusion: bool | None = None
    """Fused rotary-embedding kernel (TE; null: with TE)."""
    bias_activation_fusion: bool | None = None
    """Fused SwiGLU (megatron's fused kernel; null: on CUDA)."""
    gradient_accumulation_fusion: bool | None = None
    """Accumulate weight gradients inside the GEMM into the fp32 main_grad (null: with TE). TE's
    layers do it themselves; megatron's own linears (the output layer in either spec, every layer
    of the local spec) need apex's fused_weight_gradient_mlp_cuda and, without it, accumulate
    unfused (actor/build.py: build_gpt_model)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in backward: none; selective (recompute_modules); full (every
    transformer layer, uniformly)."""
    recompute_modules: list[str] | None = None
    """With recompute=selective: megatron's module names (core_attn, moe_act, layernorm, mlp, moe,
    shared_experts); null: megatron's default (core_attn)."""

    def resolve(self, available: Available) -> "ComputeSettings":
        """Nulls replaced by what `available` supports; ValueError naming the setting when one that
        was asked for cannot run here (at start, never deep in a step)."""
        te, cuda = available.transformer_engine, available.cuda
        spec_te = te if self.transformer_engine is None else self.transformer_engine
        out = ComputeSettings(
            transformer_engine=spec_te,
            moe_grouped_gemm=spec_te if self.moe_grouped_gemm is None else self.moe_grouped_gemm,
            moe_permute_fusion=te if self.moe_permute_fusion is None else self.moe_permute_fusion,
            apply_rope_fusion=te if self.apply_rope_fusion is None else self.apply_rope_fusion,
            bias_activation_fusion=(cuda if self.bias_activation_fusion is None
                                    else self.bias_activation_fusion),
            gradient_accumulation_fusion=(spec_te if self.gradient_accumulation_fusion is None
                                          else self.gradient_accumulation_fusion),
            recompute=self.recompute, recompute_modules=self.recompute_modules)
        missing_te = "Transformer Engine, which does not import here (it needs CUDA and cuDNN)"
        for name in ("transformer_engine", "moe_grouped_gemm", "moe_permute_fusion", "apply_rope_fusion"):
            if getattr(out, name) and not te:
                raise ValueError(f"{name}=True needs {missing_te}")
        if out.moe_grouped_gemm and not out.transformer_engine:
            raise ValueError("moe_grouped_gemm=True needs transformer_engine=True (TE's grouped GEMM)")
        if out.bias_activation_fusion and not cuda:
            raise ValueError("bias_activation_fusion=True needs CUDA")
        if out.gradient_accumulation_fusion and not (out.transformer_engine or available.apex_wgrad):
            raise ValueError("gradient_accumulation_fusion=True needs the TE layer spec or apex's "
                             "fused_weight_gradient_mlp_cuda extension, which is not installed")
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(f"recompute_modules={self.recompute_modules}: expected null unless "
                             "recompute is 'selective'")
        return out

    def transformer_config_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields of resolved settings (model_specs takes them as overrides)."""
        if self.transformer_engine is None:
            raise ValueError("resolve() the compute settings first")
        fields: dict[str, Any] = dict(moe_grouped_gemm=self.moe_grouped_gemm, moe_permute_fusion=self.moe_permute_fusion,
                      apply_rope_fusion=self.apply_rope_fusion,
                      bias_activation_fusion=self.bias_activation_fusion,
                      gradient_accumulation_fusion=self.gradient_accumulation_fusion)
        if self.recompute == "selective":
            fields.update(recompute_granularity="selective")
            if self.recompute_modules is not None:
                fields.update(recompute_modules=list(self.recompute_modules))
        elif self.recompute == "full":
            fields.update(recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1)
        return fields

    def describe(self, available: Available | None = None) -> str:
        """One line of what runs; with `available`, where the accumulation fusion stops short."""
        on = [n for n in ("moe_grouped_gemm", "moe_permute_fusion", "apply_rope_fusion",
                          "bias_activation_fusion", "gradient_accumulation_fusion") if getattr(self, n)]
        if self.gradient_accumulation_fusion and available is not None and not available.apex_wgrad:
            on[-1] += " (TE layers; output layer unfused: no apex)"
        return (f"{'TE' if self.transformer_engine else 'local'} spec, on: {', '.join(on) or 'none'}, "
                f"recompute {self.recompute}")
