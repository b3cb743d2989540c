"""Start-up and tear-down of a training run: everything the RL loop (trainer.py) works with.

    run = setup(cfg)        # checks, actor, SGLang servers, weights (initial or resumed)
    begin_rl(run)           # KL reference; the servers get the policy RL starts from
    ...                     # trainer.run_loop(run)
    teardown(run)

Order matters: every input that can be checked is checked (config, layout against the world size
and the model, prompt file, model files, the resume checkpoint) before anything is written, converted
or started, so a bad input costs seconds and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.actor.packing import resolve_packing
from gspo_megatron.actor.settings import Available
from gspo_megatron.checkpoint.loop_state import LoopState
from gspo_megatron.checkpoint.manager import CheckpointManager
from gspo_megatron.config import ConfigError, RunConfig
from gspo_megatron.driver import Driver, on_driver, scratch_dir
from gspo_megatron.metrics import MetricsWriter
from gspo_megatron.run_folders import lock_run_folders, release
from gspo_megatron.staleness import share_cpu_with_servers
from gspo_megatron.stop import GracefulStop
from rollout.ports import free_port

INITIAL_DIR = "initial_megatron"
REFERENCE_DIR = "reference"
# At least one of these makes a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclasses.dataclass
class Run:
    """What the loop works with (built by `setup`)."""
    cfg: RunConfig
    rank: int
    world: int
    actor: Any                       # gspo_megatron.actor.Actor
    driver: Driver | None            # rank 0 only
    sync: Any                        # gspo_megatron.sync.WeightSync
    ckpt: CheckpointManager | None
    writer: MetricsWriter
    loop: LoopState
    resumed_from: Path | None = None
    export_src: Path | None = None   # megatron checkpoint of the final policy, for export_hf
    stop: GracefulStop = dataclasses.field(default_factory=lambda: GracefulStop(enabled=False))
    locks: list = dataclasses.field(default_factory=list)  # rank 0: its folders' RunLocks

    def final_model_checkpoint(self) -> Path:
        """Collective. A megatron checkpoint of the current policy: the last checkpoint's model if
        it is of this step, else a fresh model-only checkpoint in a scratch directory."""
        from gspo_megatron.checkpoint.model_io import save_model
        latest = self.ckpt.latest() if self.ckpt else None
        if latest is not None and latest.name.endswith(f"{self.loop.step:08d}"):
            return latest / "model"
        src = scratch_dir(self.cfg, "final_megatron")
        if self.rank == 0 and src.exists():
            shutil.rmtree(src)
        dist.barrier()
        save_model(self.actor.models, src, hf_dir=self.cfg.model.hf_path)
        dist.barrier()
        return src


# --- checks before anything is spent ----------------------------------------------------------------
def rank_env() -> tuple[int, int]:
    """torchrun / srun variables; a plain `gspo-megatron train` is a one-rank job."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


@dataclasses.dataclass
class Inputs:
    """What check_inputs established about the run's inputs."""
    model_fingerprint: dict[str, Any]     # what the run's derived state must have been made from
    resume_from: Path | None              # the complete, verified checkpoint to resume from
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt set's fingerprint
    new_prompt_epoch: bool = False        # resume over a changed prompt set: start a new epoch
    prompt_rows: Any = None               # rank 0, rollout.max_prompt_tokens: the rows kept


def check_inputs(cfg: RunConfig, world: int) -> Inputs:
    """Cheap checks every rank makes before anything is written or started: the model directory
    (config, layout against the world size and the model, weight files, tokenizer), the prompt
    file, the initial checkpoint, and the checkpoint a resume would load."""
    from gspo_megatron.checkpoint.fingerprint import describe_change, model_fingerprint, read_fingerprint
    from gspo_megatron.checkpoint.loop_state import load_driver_state
    from gspo_megatron.checkpoint.manager import CheckpointError
    from model_specs import load_hf_config, model_dims_for
    from gspo_megatron.early_checks import check_model_dir, check_prompts
    from gspo_megatron.run_folders import check_outputs, check_prompt_set, drop_overlong_prompts
    from rollout.prompt_sets import prompt_set_fingerprint
    hf = check_model_dir(cfg)
    dims = model_dims_for(load_hf_config(hf))
    cfg.parallel.validate_model(**dims)  # what holds at any world size first, then the world size
    available = Available.detect()
    try:
        compute = cfg.compute.resolve(available)  # a kernel this machine lacks: named now
    except ValueError as e:
        raise ConfigError(f"compute.{e}") from None
    half = cfg.model.dtype == "bfloat16"
    cfg.parallel.check_context_parallel(transformer_engine=compute.transformer_engine,
                                        cuda=available.cuda, half=half)
    cfg.parallel.validate(world, **dims)
    try:  # the Actor resolves it the same way
        resolve_packing(cfg.train.pack_sequences, te_on_cuda=compute.transformer_engine and available.cuda,
                        context=cfg.parallel.context, half=half, te_version=available.te_version)
    except ValueError as e:
        raise ConfigError(f"train.{e}") from None
    fingerprint = model_fingerprint(hf)  # reads every weight file's header: DamagedFileError names it
    if not any((hf / n).is_file() for n in TOKENIZER_FILES):
        raise FileNotFoundError(f"model.hf_path={str(hf)!r}: no tokenizer there (none of "
                                f"{', '.join(TOKENIZER_FILES)})")
    train_set, _ = check_prompts(cfg)  # PromptFileError names the file, the row and the key
    r = cfg.rollout
    prompts = prompt_set_fingerprint(train_set.files(), train_set.total_rows, selection={
        "prompt_key": r.prompt_key, "answer_key": r.answer_key, "max_prompt_tokens": r.max_prompt_tokens})
    kept = None
    if r.max_prompt_tokens and int(os.environ.get("RANK", "0")) == 0:  # the driver's rows
        kept = drop_overlong_prompts(cfg, train_set, hf)
    if cfg.distill.teacher:  # before any server starts: the teacher must read the student's tokens
        from rollout.teacher import vocabulary_mismatch
        teacher = Path(cfg.distill.teacher)
        if not (teacher / "config.json").is_file():
            raise FileNotFoundError(f"distill.teacher={str(teacher)!r}: no config.json there (expected a "
                                    "Hugging Face model directory)")
        why = vocabulary_mismatch(str(hf), str(teacher))
        if why:
            raise ConfigError(f"distill.teacher={str(teacher)!r} has {why} (model.hf_path={str(hf)!r}); "
                              "on-policy distillation needs the student's tokenizer")
    if cfg.rollout.environment:
        from gspo_megatron.episodes import env_factory
        env_factory(cfg.rollout)  # EnvironmentSpecError names a bad name, module, class or args
    else:
        from rollout.rewards.registry import check_reward
        for reward in {cfg.rollout.reward, cfg.eval.reward or cfg.rollout.reward}:
            # an unknown name, a module:function that fails, no sandbox, a service that is down
            note = check_reward(reward, r.code_sandbox, r.reward_service)
            if note and int(os.environ.get("RANK", "0")) == 0:
                print(f"[gspo] {note}", flush=True)
    if cfg.model.megatron_checkpoint and not (Path(cfg.model.megatron_checkpoint) / "metadata.json").is_file():
        raise FileNotFoundError(f"model.megatron_checkpoint={cfg.model.megatron_checkpoint!r}: not a "
                                f"megatron dist_checkpointing directory (no metadata.json)")
    resume_from, new_epoch = None, False
    if cfg.checkpoint.dir:
        ckpt = CheckpointManager(cfg.checkpoint.dir)
        resume_from = ckpt.latest()
    # Every folder the run writes: writable, room for a checkpoint, a harmless export target.
    check_outputs(cfg, hf, ckpt.size_bytes(resume_from) if resume_from else None,
                  resuming=resume_from is not None)
    if resume_from is not None:
        # The manifest: the first missing, short or changed file (each rank checks its share).
        ckpt.verify(resume_from, checksums=cfg.checkpoint.verify_checksums,
                    share=(int(os.environ.get("RANK", "0")), world))
        extra = load_driver_state(resume_from).extra
        new_epoch = check_prompt_set(cfg, extra.get("prompts"), prompts)
        change = describe_change(extra.get("source_model"), fingerprint)
        if change and "no record" not in change:
            raise CheckpointError(f"checkpoint.dir={cfg.checkpoint.dir!r} holds a run of another model "
                                  f"than model.hf_path={str(hf)!r} ({change}); resume with that "
                                  f"model, or start over in a new checkpoint.dir")
        if cfg.loss.kl_coef > 0:
            ref = Path(cfg.checkpoint.dir) / REFERENCE_DIR
            if not (ref / "model.safetensors").is_file():
                raise ConfigError(f"loss.kl_coef={cfg.loss.kl_coef}: resuming from {resume_from}, "
                                  f"but {ref / 'model.safetensors'} (the KL reference of this run) does "
                                  "not exist; was the run started with kl_coef=0? Start a new run "
                                  "(new checkpoint.dir)")
            change = describe_change(read_fingerprint(ref)[1], fingerprint)
            if change and "no record" not in change:
                raise CheckpointError(f"{ref} (the KL reference) was made from another model than "
                                      f"model.hf_path={str(hf)!r} ({change}); start a new run")
    return Inputs(fingerprint, resume_from, prompts, new_epoch, kept)


def initial_megatron_checkpoint(cfg: RunConfig, rank: int, fingerprint: dict[str, Any]) -> Path:
    """The megatron checkpoint of the initial policy: model.megatron_checkpoint, or hf_path
    converted once by rank 0 (before torch.distributed starts: the converter runs its own
    one-process megatron) into a scratch dir every rank can read.

    The conversion is written into a temporary directory and renamed into place when complete,
    with the fingerprint of the model it was made from: a conversion of another model (or of a
    changed one) is made again, a killed one leaves nothing that looks complete."""
    from gspo_megatron.checkpoint.fingerprint import describe_change, read_fingerprint, write_fingerprint
    if cfg.model.megatron_checkpoint:
        return Path(cfg.model.megatron_checkpoint)
    out = scratch_dir(cfg, INITIAL_DIR, create=False)
    if rank == 0:
        source, stored = read_fingerprint(out)
        change = describe_change(stored, fingerprint) if (out / "metadata.json").is_file() else "incomplete"
        if change:
            from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
            if out.exists():
                print(f"[gspo] {out} is not a conversion of {cfg.model.hf_path} ({change}; made from "
                      f"{source}): converting again", flush=True)
            else:
                print(f"[gspo] converting the initial model {cfg.model.hf_path} (HF) into a megatron "
                      f"checkpoint at {out}", flush=True)
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                convert_hf_to_megatron(cfg.model.hf_path, tmp)
                write_fingerprint(tmp, fingerprint, cfg.model.hf_path)
            except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
                # (torch/distributed/checkpoint/api.py:30); a full disk becomes one line, the rest re-raised
                _raise_if_disk_full(e, tmp, cfg.model.hf_path)
                raise
            shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
    return out  # the other ranks read it after the first collective (Actor construction)


def _raise_if_disk_full(error: BaseException, tmp: Path, hf_path: str) -> None:
    from gspo_megatron.checkpoint.hf_files import weight_files
    from gspo_megatron.checkpoint.manager import CheckpointError, write_failure_kind
    enospc, short_write = write_failure_kind(error)
    if not (enospc or short_write):
        return
    shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
    need = sum(f.stat().st_size for f in weight_files(Path(hf_path)))
    free = shutil.disk_usage(tmp.parent).free
    raise CheckpointError(f"converting model.hf_path={hf_path!r} into {tmp.parent / INITIAL_DIR} "
                          f"failed: no space left on device ({free} bytes free, about {need} bytes "
                          "needed: the model's weight files); free space and rerun") from None


# --- building ---------------------------------------------------------------------------------------
def build_actor(cfg: RunConfig):
    from gspo_megatron.actor import Actor, LogProbSettings
    t = cfg.train
    # Routing drift compares pi_old's routing with the updated policy's: with asynchronous
    # rollouts pi_old spans several versions, so its default is off there (config.validate
    # refuses drift=true).
    routing = dataclasses.replace(cfg.moe, drift=False) if t.max_staleness and cfg.moe.drift is None else cfg.moe
    return Actor(cfg.model.hf_path, cfg.parallel, optimizer=t, loss=cfg.loss,
                 logprob=LogProbSettings(temperature=cfg.rollout.temperature),
                 batching=t, old_log_probs=t.old_log_probs, seed=t.seed,
                 params_dtype=getattr(torch, cfg.model.dtype), compute=cfg.compute, routing=routing,
                 max_staleness=t.max_staleness if t.old_log_probs == "recompute" else 0)


def start_driver(cfg: RunConfig, rank: int, prompt_rows=None) -> Driver | None:
    """Rank 0 starts (or attaches) the servers; a failure there stops every rank."""
    holder: list[Driver] = []

    def start() -> str:
        holder.append(Driver.start(cfg, str(scratch_dir(cfg, "logs")), prompt_rows=prompt_rows))
        return "ok"
    on_driver(rank, start)
    return holder[0] if holder else None


def build_sync(cfg: RunConfig, actor, driver: Driver | None):
    from gspo_megatron.sync.transports import DiskTransport, DistributedTransport, TensorTransport
    from gspo_megatron.sync.weight_sync import WeightSync
    from model_specs import load_hf_config
    transport = None
    if driver is not None:
        kind = cfg.sync.transport
        if kind == "disk":
            root = Path(cfg.sync.dir) if cfg.sync.dir else scratch_dir(cfg, "sync")
            transport = DiskTransport(driver.pool, root, cfg.model.hf_path)
        elif kind == "tensor":
            transport = TensorTransport(driver.pool)
        else:
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            transport = DistributedTransport(driver.pool, addr, free_port())
    return WeightSync(actor.chunks, load_hf_config(cfg.model.hf_path), transport,
                      driver.pool if driver else None, bucket_bytes=cfg.sync.bucket_mb << 20)


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
    init_ckpt = None if resume_from else initial_megatron_checkpoint(cfg, rank, inputs.model_fingerprint)
    if rank == 0:
        print(f"[gspo] {cfg.describe_loss()}", flush=True)
    actor = build_actor(cfg)
    if rank == 0:
        available = Available.detect()
        print(f"[gspo] layout {actor.layout.describe(world)} on {world} rank(s); compute: "
              f"{cfg.compute.resolve(available).describe(available)}", flush=True)
    run = Run(cfg, rank, world, actor, None, None, ckpt, MetricsWriter(None, enabled=False),
              LoopState(extra={"source_model": inputs.model_fingerprint, "prompts": inputs.prompts}),
              resumed_from=resume_from, stop=stop)
    if ckpt:
        ckpt.clean_incomplete()
    run.driver = start_driver(cfg, rank, inputs.prompt_rows)
    if run.driver is not None:  # after a signal, no server call waits for the health probe
        run.driver.pool.stop_requested = stop.requested
        run.driver.pool.abort_timeout_s = cfg.rollout.abort_timeout_s
    if resume_from:
        run.loop = ckpt.load(resume_from, actor)
        run.loop.extra["prompts"] = inputs.prompts
        if inputs.new_prompt_epoch and run.loop.data_cursor:  # rollout.prompts_changed=restart_epoch
            run.loop.data_cursor = {**run.loop.data_cursor, "position": 0,
                                    "epoch": run.loop.data_cursor["epoch"] + 1}
        if rank == 0:
            run.driver.load_state(run.loop.data_cursor, run.loop.rollout_buffer)
            print(f"[gspo] resumed from {resume_from} (step {run.loop.step})", flush=True)
    else:
        actor.load_weights(init_ckpt)
    run.sync = build_sync(cfg, actor, run.driver)
    if rank == 0 and cfg.logging.tensorboard_dir:
        run.writer = MetricsWriter(cfg.logging.tensorboard_dir, jsonl_path=cfg.logging.metrics_jsonl,
                                   purge_step=run.loop.step if resume_from else None)
        print(f"[gspo] TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}", flush=True)
    return run


def begin_rl(run: Run) -> None:
    """After any warm start: the KL reference is the current policy, and the servers get it."""
    if run.cfg.loss.kl_coef > 0:
        set_up_reference(run)
    # Servers started here hold the HF weights; attached ones may hold anything (another run's
    # policy): always give them the policy this run starts from, under a new weight version.
    run.loop.weight_version += 1
    run.sync.sync(run.loop.weight_version)


def set_up_reference(run: Run) -> None:
    """The KL reference is the policy RL starts from (after the warm start). It is saved once, to
    checkpoint.dir/reference/model.safetensors (one-process tensors, rank 0, atomic), so that a
    resumed run, in any layout, penalises against the same policy."""
    from safetensors.torch import load_file, save_file
    path = Path(run.cfg.checkpoint.dir) / REFERENCE_DIR / "model.safetensors" if run.ckpt else None
    if run.resumed_from is not None and path is not None:  # check_inputs found it, same model
        run.actor.set_reference(load_file(str(path)))
        return
    run.actor.set_reference()
    if path is None:
        return
    from gspo_megatron.checkpoint.fingerprint import write_fingerprint
    full = run.actor.full_state_dict(to_all_ranks=False)
    if run.rank == 0:  # the directory appears complete (weights + source) or not at all
        tmp = path.parent.with_name(path.parent.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / path.name))
        write_fingerprint(tmp, run.loop.extra["source_model"], run.cfg.model.hf_path)
        shutil.rmtree(path.parent, ignore_errors=True)
        os.rename(tmp, path.parent)
    dist.barrier()


# --- tear-down --------------------------------------------------------------------------------------
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


def export_hf(src: Path, cfg: RunConfig) -> None:
    """The final policy as HF safetensors (rank 0, after the process groups are gone), published
    whole into checkpoint.export_hf: it replaces only an earlier export (output_dirs)."""
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from gspo_megatron.run_folders import export_rules
    out = convert_megatron_to_hf(src, cfg.checkpoint.export_hf, field="checkpoint.export_hf",
                                 **export_rules(cfg))
    print(f"[gspo] exported the final policy to {out} (HF format)", flush=True)
