"""The GSPO RL loop (DESIGN.md "One step of the loop"), run by every trainer rank.

    gspo-megatron train examples/tiny_moe_digits.yaml --set train.steps=3
    torchrun --nproc-per-node 2 -m gspo_megatron.cli train CONFIG --set parallel.tensor=2

Rank 0 is also the driver: it owns the SGLang servers (started here, or attached by URL), the
prompts, rollouts and rewards, and hands every rank the rollout batch (broadcast over the default
group); each rank takes its data-parallel share. `run_loop` below is the whole loop on one screen.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint.loop_state import LoopState
from gspo_megatron.checkpoint.manager import CheckpointManager
from gspo_megatron.config import ConfigError, RunConfig
from gspo_megatron.driver import Driver, broadcast_object, scratch_dir, sft_batch
from gspo_megatron.metrics import MetricsWriter, format_progress


class DriverError(RuntimeError):
    """Raised on every rank when rank 0 (the driver) failed; the message is rank 0's error."""


class PhaseTimer(dict):
    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self[f"time/{phase}"] = self.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


@dataclasses.dataclass
class Run:
    """What the loop works with (built by `setup`)."""
    cfg: RunConfig
    rank: int
    actor: Any
    driver: Driver | None            # rank 0 only
    sync: Any                        # gspo_megatron.sync.WeightSync
    ckpt: CheckpointManager | None
    writer: MetricsWriter
    loop: LoopState
    export_src: Path | None = None   # megatron checkpoint of the final policy, for export_hf


def run_loop(run: Run) -> None:
    cfg, actor, loop = run.cfg, run.actor, run.loop
    ckpt_time: dict[str, float] = {}
    for step in range(loop.step, cfg.train.steps):
        t = PhaseTimer()
        with t("step"):
            with t("rollout"):  # rank 0 generates and scores; every rank receives the batch
                batch, metrics, gen_tokens = on_driver(run, lambda: run.driver.rollout_batch(
                    str(loop.weight_version)))
            shard = actor.shard(batch, num_mini_batches=cfg.train.mini_batches)  # my DP rows
            with t("log_probs"):  # pi_old: forward-only recompute, or the engine's log-probs
                old = actor.compute_old_log_probs(shard)
            if cfg.loss.kl_coef > 0:
                with t("ref_log_probs"):  # the KL reference: forward-only with its weights swapped in
                    actor.compute_ref_log_probs(shard)
            with t("train"):  # k mini-batch GSPO updates (paper: 4)
                updates = [actor.train_step(mini) for mini in shard.mini_batches()]
            with t("sync"):  # new weights into SGLang before the next rollout
                loop.weight_version += 1
                run.sync.sync(loop.weight_version)
            loop.step = step + 1
        metrics.update(train_metrics(updates, old), **t, **ckpt_time)
        metrics["perf/tokens_per_s"] = float(batch.lengths.sum()) / t["time/step"]
        run.writer.log(step, metrics)  # before the checkpoint: a resume never loses a step's metrics
        if run.rank == 0 and cfg.logging.progress:
            print(format_progress(step, cfg.train.steps, metrics), flush=True)
        ckpt_time = {}
        if run.ckpt and (loop.step % cfg.checkpoint.interval == 0 or loop.step == cfg.train.steps):
            t0 = time.perf_counter()
            save_checkpoint(run)
            ckpt_time = {"time/checkpoint": time.perf_counter() - t0}  # logged with the next step


# --- the pieces ------------------------------------------------------------------------------------
def on_driver(run: Run, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 and broadcast its result to every rank. If it raises on rank 0, every
    rank raises (rank 0 the original error, the others DriverError): no rank is left waiting."""
    result, error = None, None
    if run.rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below after telling the other ranks
            error = e
    payload = broadcast_object(("error", f"{type(error).__name__}: {error}") if error
                               else ("ok", result))
    if error is not None:
        raise error
    if payload[0] == "error":
        raise DriverError(f"rank 0 failed: {payload[1]}")
    return payload[1]


def train_metrics(updates: list[dict[str, float]], old: dict[str, float]) -> dict[str, float]:
    """Mini-batch metrics of the actor -> per-step TensorBoard scalars."""
    def mean(k: str) -> float | None:
        vals = [u[k] for u in updates if k in u]
        return sum(vals) / len(vals) if vals else None
    out = {
        "train/loss": mean("loss"), "train/clip_fraction": mean("clip_fraction"),
        "train/seq_ratio_mean": mean("seq_ratio_mean"),
        "train/seq_ratio_min": min((u["seq_ratio_min"] for u in updates if "seq_ratio_min" in u),
                                   default=None),
        "train/seq_ratio_max": max((u["seq_ratio_max"] for u in updates if "seq_ratio_max" in u),
                                   default=None),
        "train/grad_norm": mean("grad_norm"), "train/lr": updates[-1].get("lr"),
        "train/entropy": old.get("entropy_mean", mean("entropy_mean")),
        "train/kl": mean("kl"),
        # The first (on-policy) pass compares trainer and SGLang on the same weights.
        "train/logprob_abs_diff": old.get("logprob_abs_diff_vs_rollout",
                                          mean("logprob_abs_diff_vs_rollout")),
    }
    return {k: v for k, v in out.items() if v is not None}


def save_checkpoint(run: Run) -> None:
    if run.rank == 0:
        state = run.driver.state()
        run.loop.data_cursor, run.loop.rollout_buffer = state["stream"], state["manager"]
    run.ckpt.save(run.loop.step, run.actor.chunks, run.actor.optimizer, run.actor.scheduler, run.loop)


def warm_start(run: Run) -> None:
    """Supervised warm start: `warm_start_steps` cross-entropy steps on the prompt file's answers
    (teaches a tiny random model the answer format). Uses the RL optimizer at warm_start_lr and
    then clears its state and rewinds the LR schedule, so RL starts from a fresh optimizer."""
    from gspo_megatron.actor.train import LossSettings, train_step
    cfg, actor = run.cfg, run.actor
    n = cfg.train.warm_start_batch_size
    frozen = _FrozenScheduler()
    for k in range(cfg.train.warm_start_steps):
        examples = on_driver(run, lambda: run.driver.warm_start_examples(n, offset=k * n))
        shard = actor.shard(sft_batch(examples))
        for group in actor.optimizer.param_groups:
            group["lr"] = cfg.train.warm_start_lr
        m = train_step(actor.chunks, actor.optimizer, frozen, shard,
                       micro_batch_size=actor.micro_batch_size, loss=LossSettings(name="ce"),
                       logprob=actor.logprob)
        if run.rank == 0 and cfg.logging.progress and (k % 10 == 0 or k == cfg.train.warm_start_steps - 1):
            print(f"warm start {k + 1}/{cfg.train.warm_start_steps} | ce {m['loss']:.3f}", flush=True)
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        sub.optimizer.state.clear()
    actor.scheduler.step(increment=0)  # puts the RL learning rate back


class _FrozenScheduler:
    def step(self, increment: int = 1) -> None:
        pass


# --- set-up and tear-down -----------------------------------------------------------------------------
def _rank_env() -> tuple[int, int]:
    """torchrun / srun variables; a plain `gspo-megatron train` is a one-rank job."""
    if "RANK" not in os.environ:
        from rollout.server import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_inputs(cfg: RunConfig) -> None:
    """Cheap checks every rank can make before anything starts (files exist, settings agree)."""
    hf = Path(cfg.model.hf_path)
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path={str(hf)!r}: no config.json there (expected a "
                                f"Hugging Face model directory)")
    if not Path(cfg.rollout.prompts).is_file():
        raise FileNotFoundError(f"rollout.prompts={cfg.rollout.prompts!r}: file not found")
    if cfg.model.megatron_checkpoint and not (Path(cfg.model.megatron_checkpoint) / "metadata.json").is_file():
        raise FileNotFoundError(f"model.megatron_checkpoint={cfg.model.megatron_checkpoint!r}: not a "
                                f"megatron dist_checkpointing directory (no metadata.json)")


def initial_megatron_checkpoint(cfg: RunConfig, rank: int, world: int) -> Path:
    """The megatron checkpoint of the initial policy: model.megatron_checkpoint, or hf_path
    converted once by rank 0 (before torch.distributed starts: the converter runs its own
    one-process megatron) into a scratch dir every rank can read."""
    if cfg.model.megatron_checkpoint:
        return Path(cfg.model.megatron_checkpoint)
    out = scratch_dir(cfg, "initial_megatron")
    if rank == 0 and not (out / "metadata.json").is_file():
        from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
        shutil.rmtree(out)
        convert_hf_to_megatron(cfg.model.hf_path, out)
    return out  # the other ranks read it after the first collective (Actor construction)


def hf_config(cfg: RunConfig) -> dict:
    """The model's HF config with the field names model_specs reads (transformers 5 renames some)."""
    from model_specs import load_hf_config
    from model_specs.weight_maps import normalize_hf_config
    return normalize_hf_config(load_hf_config(cfg.model.hf_path))


def build_sync(cfg: RunConfig, actor, driver: Driver | None):
    from gspo_megatron.sync.transports import DiskTransport, DistributedTransport, TensorTransport
    from gspo_megatron.sync.weight_sync import WeightSync
    transport = None
    if driver is not None:
        kind = cfg.sync.transport
        if kind == "disk":
            root = Path(cfg.sync.dir) if cfg.sync.dir else scratch_dir(cfg, "sync")
            transport = DiskTransport(driver.pool, root, cfg.model.hf_path)
        elif kind == "tensor":
            transport = TensorTransport(driver.pool)
        else:
            from rollout.server import free_port
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            transport = DistributedTransport(driver.pool, addr, free_port())
    return WeightSync(actor.chunks, hf_config(cfg), transport,
                      driver.pool if driver else None, bucket_bytes=cfg.sync.bucket_mb << 20)


def setup(cfg: RunConfig) -> Run:
    from gspo_megatron.actor import actor as actor_mod
    from gspo_megatron.actor.build import OptimizerSettings
    from gspo_megatron.actor.forward import LogProbSettings
    from gspo_megatron.actor.train import LossSettings
    from gspo_megatron.checkpoint.model_io import load_model
    rank, world = _rank_env()
    check_inputs(cfg)
    t, r = cfg.train, cfg.rollout
    ckpt = CheckpointManager(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                             hf_dir=cfg.model.hf_path) if cfg.checkpoint.dir else None
    resume_from = ckpt.latest() if ckpt else None
    init_ckpt = None if resume_from else initial_megatron_checkpoint(cfg, rank, world)
    if rank == 0:
        print(f"[gspo] {cfg.describe_loss()}", flush=True)
    eps_low, eps_high = cfg.loss.clip_range()
    actor = actor_mod.Actor(
        hf_config(cfg), cfg.parallel,
        optimizer=OptimizerSettings(
            optimizer=t.optimizer, lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps,
            lr_decay_steps=max(1, t.steps * t.mini_batches), lr_decay_style=t.lr_decay_style,
            weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
            clip_grad=t.clip_grad, use_distributed_optimizer=t.use_distributed_optimizer),
        loss=LossSettings(name=cfg.loss.name, eps_low=eps_low, eps_high=eps_high,
                          old_log_probs=t.old_log_probs, kl_coef=cfg.loss.kl_coef,
                          kl_estimator=cfg.loss.kl_estimator),
        logprob=LogProbSettings(temperature=r.temperature), micro_batch_size=t.micro_batch_size,
        seed=t.seed, params_dtype=getattr(torch, cfg.model.dtype))
    if rank == 0:
        print(f"[gspo] layout {actor.layout.describe(world)} on {world} rank(s)", flush=True)
    run = Run(cfg, rank, actor, None, None, ckpt, MetricsWriter(None, enabled=False), LoopState())
    if ckpt:
        ckpt.clean_incomplete()
    run.driver = _start_driver(run)
    if resume_from:
        run.loop = ckpt.load(resume_from, actor.chunks, actor.optimizer, actor.scheduler)
        if rank == 0:
            run.driver.load_state(run.loop.data_cursor, run.loop.rollout_buffer)
            print(f"[gspo] resumed from {resume_from} (step {run.loop.step})", flush=True)
    else:
        load_model(actor.models, init_ckpt)
        actor.optimizer.reload_model_params()
    run.sync = build_sync(cfg, actor, run.driver)
    if not resume_from and t.warm_start_steps > 0:
        warm_start(run)
    if cfg.loss.kl_coef > 0:
        set_up_reference(run, resume_from)
    # Servers started here hold the HF weights; attached ones may hold anything (another run's
    # policy): always give them the policy this run starts from, under a new weight version.
    run.loop.weight_version += 1
    run.sync.sync(run.loop.weight_version)
    if rank == 0 and cfg.logging.tensorboard_dir:
        run.writer = MetricsWriter(cfg.logging.tensorboard_dir, jsonl_path=cfg.logging.metrics_jsonl,
                                   purge_step=run.loop.step if resume_from else None)
        print(f"[gspo] TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}", flush=True)
    return run


def set_up_reference(run: Run, resume_from: Path | None) -> None:
    """The KL reference is the policy RL starts from (after the warm start). It is saved once, to
    checkpoint.dir/reference/model.safetensors (one-process tensors, rank 0, atomic), so that a
    resumed run, in any layout, penalises against the same policy."""
    from safetensors.torch import load_file, save_file
    path = Path(run.cfg.checkpoint.dir) / "reference" / "model.safetensors" if run.ckpt else None
    if resume_from is not None and path is not None:
        if not path.is_file():
            raise ConfigError(f"loss.kl_coef={run.cfg.loss.kl_coef}: resuming from {resume_from}, "
                              f"but {path} (the KL reference of this run) does not exist; was the "
                              "run started with kl_coef=0? Start a new run (new checkpoint.dir)")
        run.actor.set_reference(load_file(str(path)))
        return
    run.actor.set_reference()
    if path is None:
        return
    full = run.actor.full_state_dict(to_all_ranks=False)
    if run.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp))
        os.replace(tmp, path)
    dist.barrier()


def _start_driver(run: Run) -> Driver | None:
    """Rank 0 starts (or attaches) the servers; a failure there stops every rank."""
    holder: list[Driver] = []

    def start() -> str:
        holder.append(Driver.start(run.cfg, str(scratch_dir(run.cfg, "logs"))))
        return "ok"
    on_driver(run, start)
    return holder[0] if holder else None


def export_hf(run: Run, out_dir: str) -> None:
    """The final policy as HF safetensors: the last checkpoint's model (or a fresh model-only
    checkpoint) converted by rank 0 after the process groups are gone."""
    from gspo_megatron.checkpoint.model_io import save_model
    if run.ckpt and run.ckpt.latest() is not None and run.ckpt.latest().name.endswith(
            f"{run.loop.step:08d}"):
        src = run.ckpt.latest() / "model"
    else:
        src = scratch_dir(run.cfg, "final_megatron")
        if run.rank == 0 and src.exists():
            shutil.rmtree(src)
        dist.barrier()
        save_model(run.actor.models, src, hf_dir=run.cfg.model.hf_path)
    dist.barrier()
    run.export_src = src  # converted in teardown (needs no process group)


def train(cfg: RunConfig) -> int:
    """Run the whole job on this rank; returns the process exit code."""
    run = None
    try:
        run = setup(cfg)
        run_loop(run)
        if cfg.checkpoint.export_hf:
            export_hf(run, cfg.checkpoint.export_hf)
    finally:
        if run is not None:
            run.writer.close()
            if run.driver is not None:
                run.driver.stop()
        from gspo_megatron.parallel.process_groups import destroy_process_groups
        if dist.is_initialized():
            destroy_process_groups()
    if run is not None and cfg.checkpoint.export_hf and run.rank == 0:
        from gspo_megatron.checkpoint.export import convert_megatron_to_hf
        out = Path(cfg.checkpoint.export_hf)
        if out.exists():
            shutil.rmtree(out)
        convert_megatron_to_hf(run.export_src, out)
        print(f"[gspo] exported the final policy to {out} (HF format)", flush=True)
    return 0


if __name__ == "__main__":
    from gspo_megatron.cli import main
    sys.exit(main())
