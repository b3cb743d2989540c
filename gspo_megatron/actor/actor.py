"""The Actor: the policy model on megatron-core, and every verb the trainer needs from it.

    actor = Actor(hf_config_or_dir, ParallelLayout(tensor=2, pipeline=2, expert=2),
                  optimizer=OptimizerSettings(lr=1e-6), loss=LossSettings(name="gspo"),
                  micro_batch_size=4)
    shard = actor.shard(rollout_batch, num_mini_batches=4)  # this DP rank's rows of each mini-batch
    shard.old_log_probs, metrics = actor.compute_old_log_probs(shard)   # last stage: [b, s]
    for mini in shard.mini_batches():
        metrics = actor.train_step(mini)          # same scalar dict on every rank
    scheduler_state = actor.save(path)            # model + optimizer shards (collective)
    actor.load(path, scheduler_state)

Every rank of the job constructs the Actor (torchrun / srun set RANK, WORLD_SIZE, MASTER_*).
The layout is checked against the real world size and the model before any collective.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from pathlib import Path
from typing import Any, ClassVar, Mapping, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer

from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.actor.build import build_model_chunks, build_optimizer, check_layout, spec_for_layout, unwrap
from gspo_megatron.actor.forward import is_last_stage_rank, set_fused
from gspo_megatron.actor.batching.packing import resolve_sequence_layout
from gspo_megatron.actor.release import cut_hidden_references, release_process_caches
from gspo_megatron.actor.router_control import Routing, check_routed_experts
from gspo_megatron.actor.batching.balance import model_work
from gspo_megatron.actor.held.policies import HeldPolicies
from gspo_megatron.actor.held.snapshots import VersionedWeights
from gspo_megatron.actor.settings import (OLD_LOG_PROB_SOURCES, Available, ComputeSettings, LogProbSettings,
                                          MicroBatchSettings, OptimizerSettings, RoutingSettings)
from gspo_megatron.actor.steps import compute_log_probs, train_step
from gspo_megatron.actor.weights.weight_io import WeightIO
from gspo_megatron.algorithms.registry import LossSettings
from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.parallel.process_groups import init_process_groups
from model_specs import ModelSpec

_Held = TypeVar("_Held")
_CLOSED = "this Actor was closed (Actor.close()); build a new one"


def _live(value: _Held | None) -> _Held:
    if value is None:
        raise RuntimeError(_CLOSED)
    return value


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class Actor(HeldPolicies, WeightIO):
    """Model chunks (one per virtual pipeline stage), optimizer and LR scheduler of one rank."""

    # The Actors of this process not yet closed: megatron's RNG states are shared by all of them,
    # so only the last close frees them (weak: an Actor dropped unclosed leaves when collected).
    _open: ClassVar[weakref.WeakSet[Actor]] = weakref.WeakSet()

    def __init__(self, model: ModelSpec | Mapping[str, Any] | str | Path, layout: ParallelLayout, *,
                 optimizer: OptimizerSettings | None = None, loss: LossSettings | None = None,
                 logprob: LogProbSettings | None = None, micro_batch_size: int | None = None,
                 batching: MicroBatchSettings | None = None,
                 old_log_probs: str = "recompute", seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32,
                 compute: ComputeSettings | None = None, routing: RoutingSettings | None = None,
                 available: Available | None = None, max_staleness: int = 0,
                 lora: LoraSettings | None = None) -> None:
        """old_log_probs: where pi_old comes from, "recompute" (a forward-only pass before the
        updates) or "engine" (the rollout engine's own log-probs, GSPO paper §5.4). compute: TE
        spec, fused kernels, recomputation (None: what this machine supports). batching: how rows
        become micro-batches (token budgets); micro_batch_size alone is the shorthand for
        MicroBatchSettings(micro_batch_size=...). routing: MoE routing replay and drift metrics.
        available: what the machine has (None: detected; tests pass machine profiles).
        max_staleness: asynchronous rollouts, so many versions back (keep_version).
        lora: adapters on a frozen base (rank > 0; gspo_megatron/lora/): only they train, at
        lora.lr when it is set, and the KL reference is the base (the adapters off).
        Free the model and optimizer with close() (or `with Actor(...) as actor:`)."""
        self.layout = layout
        self.lora = lora or LoraSettings()
        self.optimizer_settings = optimizer or OptimizerSettings()
        if self.lora.enabled and self.lora.lr is not None:
            self.optimizer_settings = dataclasses.replace(self.optimizer_settings, lr=self.lora.lr)
        self.loss = loss or LossSettings()
        self.logprob = logprob or LogProbSettings()
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if batching is not None and micro_batch_size is not None:
            raise ValueError("pass micro_batch_size or batching, not both")
        self.batching = batching or MicroBatchSettings(micro_batch_size=micro_batch_size or 1)
        if old_log_probs not in OLD_LOG_PROB_SOURCES:
            raise ValueError(f"old_log_probs must be one of {OLD_LOG_PROB_SOURCES}, got {old_log_probs!r}")
        self.old_log_probs = old_log_probs
        available = available or Available.detect()
        self.spec = model if isinstance(model, ModelSpec) else spec_for_layout(
            model, layout, params_dtype=params_dtype, compute=compute, available=available)
        # Context parallelism and packing need TE's attention on CUDA (before any collective).
        # Packing: null means "whenever that is what runs"; not with CP (THD chunks per segment
        # are not implemented: parallel/context.py splits padded rows).
        linear_attention = self.spec.config.experimental_attention_variant == "gated_delta_net"
        if linear_attention:  # before anything is built: kernels that would refuse its backward
            available.check_gated_delta_net()
        half = self.spec.config.params_dtype in (torch.bfloat16, torch.float16)
        self.batching = dataclasses.replace(self.batching, pack_sequences=resolve_sequence_layout(
            layout, self.batching.pack_sequences, transformer_engine=self.spec.transformer_engine,
            cuda=available.cuda, half=half, te_version=available.te_version, linear_attention=linear_attention))
        # Before any collective: an impossible layout would otherwise hang the first all-reduce.
        check_layout(self.spec, layout, _world_size())
        init_process_groups(layout, seed=seed)
        self._chunks: list[DistributedDataParallel] | None = build_model_chunks(
            self.spec, layout, use_distributed_optimizer=self.optimizer_settings.use_distributed_optimizer,
            grad_reduce_in_fp32=self.optimizer_settings.grad_reduce_in_fp32,
            apex_wgrad=available.apex_wgrad, lora=self.lora, lora_seed=seed)
        set_fused(self.chunks, self.logprob.fused)
        config = self.spec.config
        self.routing_settings = (routing or RoutingSettings()).resolve(
            is_moe=bool(config.num_moe_experts), recompute=old_log_probs == "recompute",
            context_parallel=layout.context)
        self._routing: Routing | None = Routing(self.chunks, config.num_layers, config.moe_router_topk or 0)
        if self.routing_settings.replay or self.routing_settings.drift:
            self.routing.check_supported(config, replay=self.routing_settings.replay)
        self._optimizer, self.scheduler = build_optimizer(self.chunks, self.optimizer_settings)
        self._reference: list[torch.Tensor] | None = None  # KL reference: this rank's shards, on CPU
        self._versions = VersionedWeights(keep=max_staleness)  # pi_old of stale tokens (recompute)
        self._available = available
        self.released: dict[str, int] = {}  # close(): bytes each process-wide holder gave up
        Actor._open.add(self)

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free this rank's model, gradient buffers and optimizer state now (GPU memory included);
        the Actor cannot be used afterwards. Process groups stay (the trainer's teardown ends them).

        Why dropping the last reference is not enough: the model, its TransformerConfig and the
        optimizer refer to each other (config.no_sync_func -> DDP chunks, config.grad_scale_func
        -> optimizer, every module -> config), so only Python's cycle collector frees them, at a
        time that counts objects, not bytes; a new Actor built meanwhile (a benchmark, a retry
        after an out-of-memory) found the GPU still full. The cycles are cut here, then collected."""
        if self._chunks is None:
            return
        config = self.spec.config
        config.no_sync_func = config.grad_scale_func = config.finalize_model_grads_func = None
        cut_hidden_references(self._chunks)
        self._chunks = self._optimizer = self._routing = self.scheduler = self._reference = None
        self._versions = VersionedWeights(keep=0)
        Actor._open.discard(self)
        gc.collect()
        # What the process keeps for the next model (workspaces, scratch, RNG states): release.py
        self.released = release_process_caches(cuda=self._available.cuda,
                                               transformer_engine=self._available.transformer_engine,
                                               last=not Actor._open)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Actor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def chunks(self) -> list[DistributedDataParallel]:
        """The DDP-wrapped model chunks, one per virtual pipeline stage."""
        return _live(self._chunks)

    @property
    def optimizer(self) -> MegatronOptimizer:
        return _live(self._optimizer)

    @property
    def routing(self) -> Routing:
        return _live(self._routing)

    # --- layout facts -------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return ps.get_data_parallel_world_size()

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (where log-probs, old log-probs and loss live)."""
        return is_last_stage_rank()

    @property
    def models(self) -> list[torch.nn.Module]:
        """The unwrapped GPTModel of each virtual stage (for checkpointing and weight sync)."""
        return [unwrap(c) for c in self.chunks]

    # --- data ---------------------------------------------------------------------------------
    def shard(self, batch: TrainBatch, num_mini_batches: int = 1) -> TrainBatch:
        """This DP rank's rows of a global batch: its part of each of `num_mini_batches`
        consecutive mini-batches, balanced as batching.dp_balance says (TrainBatch.shard,
        balance.py); iterate `shard.mini_batches()` to train."""
        work = self.row_work()
        return batch.shard(self.dp_rank, self.dp_size, num_mini_batches,
                           work=work(batch.lengths.tolist()) if work else None)

    def receive_rows(self, rank: int, make, num_mini_batches: int = 1):
        """The trainer's path: rank 0's `make()` returns (global batch, extras) or None; every
        rank receives only its shard, packed (transfer.scatter_rows), with the routing layers of its
        own pipeline stage. Returns None or (shard, extras, transfer stats); the shard equals
        shard(batch, num_mini_batches), packed."""
        from gspo_megatron.actor.batching.transfer import scatter_rows
        return scatter_rows(rank, make, dp_rank=self.dp_rank, dp_size=self.dp_size,
                            num_mini_batches=num_mini_batches, work=self.row_work(),
                            route_layers=self.routing.layers,
                            replica_group=ps.get_model_parallel_group(),
                            stage_group=ps.get_tensor_model_parallel_group())

    def row_work(self):
        """batching.dp_balance's per-row work estimate (balance.model_work); None: by row count."""
        return model_work(self.spec, self.batching.dp_balance) if self.dp_size > 1 else None

    # --- compute ------------------------------------------------------------------------------
    def compute_old_log_probs(self, batch: TrainBatch, versions: list[int] | None = None,
                              live_version: int | None = None) -> tuple[torch.Tensor | None, dict[str, float]]:
        """pi_old for the coming updates: `(old_log_probs [b, s] on the last stage else None,
        metrics)`; the caller sets `batch.old_log_probs`.

        recompute: a forward-only pass (metrics: log_prob_mean, entropy_mean and, with rollout
        log-probs, logprob_abs_diff_vs_rollout = the train/inference mismatch). engine: the
        rollout log-probs as they are (no pass, no metrics). `versions` (asynchronous rollouts:
        the weight versions among the global batch's trained tokens, the same on every rank) other
        than `live_version`: each token's pi_old from the weights of its own version (keep_version).
        """
        if self.old_log_probs == "engine":
            if batch.rollout_log_probs is None:
                raise ValueError("old_log_probs='engine' needs batch.rollout_log_probs")
            return (batch.rollout_log_probs if self.is_last_stage else None), {}
        if versions is not None and any(v != live_version for v in versions):
            if live_version is None:
                raise ValueError("per-version pi_old needs the live version the weights hold")
            return self._versioned_old_log_probs(batch, list(versions), live_version)
        self._begin_routing(batch, record=bool(self.routing_settings.drift),
                            compare_engine=batch.routed_experts is not None)
        log_probs, metrics = compute_log_probs(self.chunks, batch, batching=self.batching,
                                               logprob=self.logprob, before_forward=self.routing.before_forward)
        metrics.update(self.routing.end())
        return log_probs, metrics

    def measure_routing_drift(self, batch: TrainBatch) -> dict[str, float]:
        """After the step's updates, over the batch compute_old_log_probs saw: `routing_drift`, the
        fraction of (token, layer) top-k sets on trained tokens that changed since pi_old, and
        per layer `routing_drift_layer/<i>` (a forward-only pass; collective)."""
        if not self.routing_settings.drift:
            raise RuntimeError("routing drift is off (RoutingSettings.drift)")
        self._begin_routing(batch, compare_old=True)
        compute_log_probs(self.chunks, batch, batching=self.batching, logprob=self.logprob,
                          before_forward=self.routing.before_forward)
        return self.routing.end()

    def _begin_routing(self, batch: TrainBatch, *, record: bool = False, compare_old: bool = False,
                       compare_engine: bool = False, replay: bool | None = None) -> None:
        replay = self.routing_settings.replay if replay is None else replay
        if batch.routed_experts is not None and self.layout.context > 1:
            raise ValueError("batch.routed_experts: the MoE routing tools are not supported with "
                             f"parallel.context={self.layout.context}")
        if batch.routed_experts is not None:
            check_routed_experts(batch, self.spec.config)
        elif replay:
            raise ValueError("routing replay needs batch.routed_experts (the rollout must ask SGLang "
                             "for them: moe.engine_routing)")
        self.routing.begin(replay=replay, record=record, compare_old=compare_old,
                           compare_engine=compare_engine, batch_shape=batch.padded_shape,
                           route_layers=batch.route_layers, offsets=batch.offsets)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard of a mini-batch; the same metrics on every rank:
        loss, clip_fraction, token_clip_fraction, seq_ratio_mean/min/max, grad_norm, lr,
        entropy_mean, logprob_abs_diff_vs_rollout (with rollout log-probs), tokens, num_sequences."""
        # With recomputed pi_old the forward-only pass reported the entropy: not again here.
        self._begin_routing(batch)
        try:
            return train_step(self.chunks, self.optimizer, self.scheduler, batch,
                              batching=self.batching, loss=self.loss, logprob=self.logprob,
                              with_entropy=self.old_log_probs == "engine",
                              before_forward=self.routing.before_forward)
        finally:
            self.routing.end()

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised (cross-entropy over trained tokens) step at learning rate `lr`, leaving
        the LR schedule where it is; for a warm start before RL (then `reset_optimizer()`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return train_step(self.chunks, self.optimizer, None, batch, batching=self.batching,
                          loss=LossSettings(name="ce"), logprob=self.logprob, with_entropy=False)

    def reset_optimizer(self) -> None:
        """Forget the optimizer state (Adam moments, step counts) and put the scheduled learning
        rate back: RL after a warm start begins with a fresh optimizer on the new weights."""
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            sub.optimizer.state.clear()
        self.scheduler.step(increment=0)

    def _local_params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in unwrap(chunk).parameters()]

    def _forward_only(self, batch: TrainBatch, **routing) -> tuple[torch.Tensor | None, dict[str, float]]:
        self._begin_routing(batch, **routing)
        try:
            log_probs, metrics = compute_log_probs(self.chunks, batch, batching=self.batching,
                                                   logprob=self.logprob,
                                                   before_forward=self.routing.before_forward)
        finally:
            routing_metrics = self.routing.end()
        return log_probs, {**metrics, **routing_metrics}

