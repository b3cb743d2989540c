"""Start-up and tear-down of a training run: everything the RL loop (trainer.py) works with.

    run = setup(cfg, stop)  # preflight checks, folders locked, actor, SGLang servers, weights
    begin_rl(run)           # KL reference; the servers get the policy RL starts from
    ...                     # trainer.run_loop(run)
    teardown(run)

Order matters: every input that can be checked is checked (preflight.check_inputs) before anything
is written, converted or started, so a bad input costs seconds and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gspo_megatron.actor.settings import Available
from gspo_megatron.checkpoint.loop_state import LoopState
from gspo_megatron.checkpoint.manager import CheckpointManager
from gspo_megatron.config import RunConfig
from gspo_megatron.driver.driver import Driver
from gspo_megatron.parallel.rank_zero import on_driver
from gspo_megatron.run.folders import (drop_records_from, lock_run_folders, release, scratch_dir,
                                       set_aside_earlier_files)
from gspo_megatron.run.metrics import MetricsWriter
from gspo_megatron.run.model_files import initial_megatron_checkpoint, load_peft_adapters, set_up_reference
from gspo_megatron.run.preflight import Inputs, check_inputs
from gspo_megatron.run.signals import GracefulStop
from rollout.servers.ports import free_port

if TYPE_CHECKING:  # built inside setup, so that importing this module loads no megatron-core
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.sync.adapter_sync import AdapterSync
    from gspo_megatron.sync.weight_sync import WeightSync
    from rollout.prompts.dataset import KeptRows


@dataclasses.dataclass
class Run:
    """What the loop works with (built by `setup`)."""
    cfg: RunConfig
    rank: int
    world: int
    actor: Actor
    driver: Driver | None            # rank 0 only
    sync: WeightSync | AdapterSync
    ckpt: CheckpointManager | None
    writer: MetricsWriter
    loop: LoopState
    resumed_from: Path | None = None
    export_src: Path | None = None   # megatron checkpoint of the final policy, for export_hf
    stop: GracefulStop = dataclasses.field(default_factory=lambda: GracefulStop(enabled=False))
    locks: list = dataclasses.field(default_factory=list)  # rank 0: its folders' RunLocks
    lost: str | None = None  # why no server took the step's weights: saved, then raised (recovery.no_server_left)

    @property
    def rank0_driver(self) -> Driver:
        """The driver, which rank 0 alone holds (the loop asks for it on rank 0 only)."""
        if self.driver is None:
            raise RuntimeError(f"rank {self.rank} holds no driver: only rank 0 drives the rollouts")
        return self.driver

    def save_checkpoint(self) -> None:
        """Collective: a checkpoint of the last finished step, with rank 0's prompt cursor and
        rollout buffer (the driver's state). Only a run with checkpoint.dir saves."""
        if self.ckpt is None:
            raise RuntimeError("save_checkpoint without checkpoint.dir")
        if self.rank == 0:
            state = self.rank0_driver.state()
            self.loop.data_cursor, self.loop.rollout_buffer = state["stream"], state["manager"]
        self.ckpt.save(self.loop.step, self.actor, self.loop)


def rank_env() -> tuple[int, int]:
    """torchrun / srun variables; a plain `gspo-megatron train` is a one-rank job."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def build_actor(cfg: RunConfig) -> Actor:
    from gspo_megatron.actor import Actor, LogProbSettings
    t = cfg.train
    # Routing drift compares pi_old's routing with the updated policy's: with asynchronous
    # rollouts pi_old spans several versions, so its default is off there (config/validation.py
    # refuses drift=true).
    routing = dataclasses.replace(cfg.moe, drift=False) if t.max_staleness and cfg.moe.drift is None else cfg.moe
    return Actor(cfg.model.hf_path, cfg.parallel, optimizer=t, loss=cfg.loss,
                 logprob=LogProbSettings(temperature=cfg.rollout.temperature),
                 batching=t, old_log_probs=t.old_log_probs, seed=t.seed,
                 params_dtype=getattr(torch, cfg.model.dtype), compute=cfg.compute, routing=routing,
                 max_staleness=t.max_staleness if t.old_log_probs == "recompute" else 0, lora=cfg.lora)


def start_driver(cfg: RunConfig, rank: int, prompt_rows: KeptRows | None = None) -> Driver | None:
    """Rank 0 starts (or attaches) the servers; a failure there stops every rank."""
    holder: list[Driver] = []

    def start() -> str:
        holder.append(Driver.start(cfg, str(scratch_dir(cfg, "logs")), scratch_dir(cfg, "prompt_cache"),
                                   prompt_rows=prompt_rows))
        return "ok"
    on_driver(rank, start)
    return holder[0] if holder else None


def build_sync(cfg: RunConfig, actor: Actor, driver: Driver | None) -> WeightSync | AdapterSync:
    """The weight sync; rank 0 (the driver) holds the transport (sync.transport, sync/transports.py).
    A LoRA run syncs its adapters only (sync/adapter_sync.py)."""
    from gspo_megatron.sync.transport_base import make_transport
    from gspo_megatron.sync.weight_sync import WeightSync
    from model_specs import load_hf_config
    if cfg.lora.enabled:
        from gspo_megatron.lora.serving import ADAPTER_NAME
        from gspo_megatron.sync.adapter_sync import AdapterSync
        return AdapterSync(actor.chunks, load_hf_config(cfg.model.hf_path), driver.pool if driver else None,
                           cfg.lora, name=ADAPTER_NAME)
    transport = None
    if driver is not None:
        transport = make_transport(cfg.sync.transport, driver.pool, hf_path=cfg.model.hf_path,
                                   sync_dir=lambda: Path(cfg.sync.dir) if cfg.sync.dir else scratch_dir(cfg, "sync"),
                                   master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                   settings=cfg.sync.transport_settings)
    return WeightSync(actor.chunks, load_hf_config(cfg.model.hf_path), transport,
                      driver.pool if driver else None, bucket_bytes=cfg.sync.bucket_mb << 20,
                      senders=cfg.sync.senders, delta=cfg.sync.delta)


def share_cpu_with_servers(cfg: RunConfig) -> None:
    """Asynchronous rollouts on a CPU machine: the SGLang servers generate while torch trains, on
    the same cores. torch's OpenMP threads spin at their barriers, so with a thread per core the
    shared cores slowed the train phase ~10x (benchmarks/async.py, 2 cores: 825 s of steps against
    58 s synchronous). torch then takes half the cores per rank's node share, unless OMP_NUM_THREADS
    says otherwise."""
    if cfg.train.max_staleness and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        cores = os.cpu_count() or 1
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        threads = max(1, cores // (2 * local))
        if threads < torch.get_num_threads():
            torch.set_num_threads(threads)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[gspo] asynchronous rollouts on CPU: torch uses {threads} of {cores} cores per rank, "
                      "the servers the rest (OMP_NUM_THREADS overrides)", flush=True)


def setup(cfg: RunConfig, stop: GracefulStop | None = None) -> Run:
    rank, world = rank_env()
    inputs = check_inputs(cfg, world)
    share_cpu_with_servers(cfg)  # asynchronous rollouts on a CPU: torch leaves the servers cores
    # The run owns its folders from here on (before anything is written into them).
    locks = lock_run_folders(cfg) if rank == 0 else []
    try:
        run = _build(cfg, rank, world, inputs, stop or GracefulStop(enabled=False))
    except BaseException:
        release(locks)
        raise
    run.locks = locks
    return run


def _build(cfg: RunConfig, rank: int, world: int, inputs: Inputs, stop: GracefulStop) -> Run:
    ckpt = CheckpointManager(cfg.checkpoint.dir, keep=cfg.checkpoint.keep, hf_dir=cfg.model.hf_path,
                             checksums=cfg.checkpoint.verify_checksums) if cfg.checkpoint.dir else None
    resume_from = inputs.resume_from
    lora = cfg.lora.enabled  # the base is loaded first, resumed or not: a checkpoint names it
    init_ckpt = None if resume_from and not lora else initial_megatron_checkpoint(cfg, rank, inputs.model_fingerprint)
    if rank == 0:
        print(f"[gspo] {cfg.describe_loss()}", flush=True)
        if lora:
            print(f"[gspo] {cfg.lora.describe()}; the base {init_ckpt} stays as it is", flush=True)
    actor = build_actor(cfg)
    if rank == 0:
        available = Available.detect()
        print(f"[gspo] layout {actor.layout.describe(world)} on {world} rank(s); compute: "
              f"{cfg.compute.resolve(available).describe(available)}", flush=True)
        from model_specs.hf.config import left_out_layers_note
        left_out = left_out_layers_note(actor.spec.hf_config)
        if left_out:
            print(f"[gspo] model: {left_out}", flush=True)
    loop = LoopState(extra={"source_model": inputs.model_fingerprint, "prompts": inputs.prompts})
    if ckpt:
        ckpt.clean_incomplete()
    driver = start_driver(cfg, rank, inputs.prompt_rows)
    if driver is not None:  # after a signal, no server call waits for the health probe
        for pool in driver.pools():
            pool.stop_requested = stop.requested
            pool.abort_timeout_s = cfg.rollout.abort_timeout_s
    if lora and init_ckpt is not None:  # with LoRA always: the base, resumed or not
        actor.load_weights(init_ckpt)
        if not resume_from and cfg.lora.init_peft:
            load_peft_adapters(actor, cfg)
    if resume_from:
        if ckpt is None:
            raise RuntimeError(f"resuming from {resume_from} without checkpoint.dir")
        loop = ckpt.load(resume_from, actor)
        loop.extra["prompts"] = inputs.prompts
        if inputs.new_prompt_epoch and loop.data_cursor:  # rollout.prompts_changed=restart_epoch
            loop.data_cursor = {**loop.data_cursor, "position": 0, "epoch": loop.data_cursor["epoch"] + 1}
        if driver is not None:  # rank 0
            driver.load_state(loop.data_cursor, loop.rollout_buffer)
            print(f"[gspo] resumed from {resume_from} (step {loop.step})", flush=True)
    elif not lora and init_ckpt is not None:
        actor.load_weights(init_ckpt)
    sync = build_sync(cfg, actor, driver)
    if rank == 0:  # each step's metrics and records once: an earlier attempt's are set aside
        if resume_from:
            drop_records_from(cfg, loop.step)
        elif (moved := set_aside_earlier_files(cfg)) is not None:
            print(f"[gspo] an earlier attempt's metrics and records (no checkpoint to resume from) moved to "
                  f"{moved}", flush=True)
    writer = MetricsWriter(None, enabled=False)
    if rank == 0 and cfg.logging.tensorboard_dir:
        writer = MetricsWriter(cfg.logging.tensorboard_dir, jsonl_path=cfg.logging.metrics_jsonl,
                               purge_step=loop.step if resume_from else None)
        print(f"[gspo] TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}", flush=True)
    return Run(cfg, rank, world, actor, driver, sync, ckpt, writer, loop, resumed_from=resume_from, stop=stop)


def begin_rl(run: Run) -> None:
    """After any warm start: the KL reference is the current policy, and the servers get it."""
    if run.cfg.loss.reference_reason:
        set_up_reference(run)
    # Servers started here hold the HF weights; attached ones may hold anything (another run's
    # policy): always give them the policy this run starts from, under a new weight version.
    run.loop.weight_version += 1
    run.sync.sync(run.loop.weight_version)


def teardown(run: Run | None) -> None:
    """Close the metrics, stop the servers this run started, leave the process groups."""
    from gspo_megatron.parallel.process_groups import destroy_process_groups
    try:
        if run is not None:
            run.writer.close()
            if run.driver is not None:
                run.driver.stop()
        if dist.is_initialized():
            destroy_process_groups()
    finally:
        if run is not None:
            release(run.locks)
