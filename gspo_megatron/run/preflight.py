"""Every check a run makes before anything is spent: nothing is written, converted or started
until they pass, so a bad input costs seconds and leaves nothing behind. Each failure is one line
naming the field, the value and what was expected (a GspoError).

    check_before_torch(cfg, world_size)   # the command line, before torch and megatron-core load
    inputs = check_inputs(cfg, world_size)  # every rank, in setup(): the rest, and what they found

check_before_torch (a fraction of a second instead of several seconds of imports): the model
directory's config.json, the parallel layout against the model's dimensions and the world size,
the prompt sets, and (rank 0) that no live run holds the run's folders.

check_inputs, again with the model family's own table, then what needs torch: compute settings,
context parallelism and packing on this machine, weight files, tokenizer, prompt rows (and the
overlong ones dropped), the teacher, the environment or reward, every output folder (writable,
room for a checkpoint, an export target that destroys nothing), and, on resume, the checkpoint's
files and checksums, its prompt set and its model.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from gspo_megatron.checkpoint.output_dirs import check_export_target, check_free_space_together, check_writable_dir
from gspo_megatron.config import ConfigError, RunConfig
from gspo_megatron.parallel.layout import LayoutError
from gspo_errors import EXIT_INPUT, EXIT_RUNTIME, GspoError, MissingInputError
from gspo_megatron.run.model_checks import (TOKENIZER_FILES, check_model_folder, check_prompts_fit,
                                           check_served_here, check_teacher)
from gspo_megatron.run.folders import (REFERENCE_DIR, check_run_folders_unlocked, export_rules, output_fields,
                                      run_root)
from gspo_megatron.sync.transports import TRANSPORTS
from model_specs.hf.config import load_hf_config, model_dims
from rollout.prompts.dataset import PromptFileError, PromptSet, load_prompts
from rollout.prompts.rows import resolved

if TYPE_CHECKING:
    from rollout.prompts.dataset import KeptRows

_Check = TypeVar("_Check", bound=Callable[..., Any])


def refusal(check: _Check) -> _Check:
    """What a start-up check raises is a refusal of the inputs (exit 2), whatever its class: a
    reward service down at start, a checkpoint of another model, a sandbox the machine forbids.
    The same class raised once the run is under way is a runtime stop (3, gspo_errors.GspoError)."""
    @functools.wraps(check)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except GspoError as e:
            if e.exit_code == EXIT_RUNTIME:
                e.exit_code = EXIT_INPUT
            raise
    return checked  # type: ignore[return-value]


def check_model_dir(cfg: RunConfig) -> Path:
    """model.hf_path, which must hold a config.json."""
    return check_model_folder("model.hf_path", cfg.model.hf_path)


def check_prompts(cfg: RunConfig) -> tuple[PromptSet, PromptSet | None]:
    """rollout.prompts and eval.prompts exist and every row has a usable prompt and answer
    (PromptFileError names the field, the file, the row and the key); nothing is written."""
    r, e = cfg.rollout, cfg.eval
    train = _open("rollout.prompts", r.prompts, r.prompt_key, r.answer_key, r.prompt_format)
    held_out = None
    if e.interval and e.prompts:
        held_out = _open("eval.prompts", e.prompts, e.prompt_key or r.prompt_key, e.answer_key or r.answer_key,
                         r.prompt_format)
    return train, held_out


def _open(field: str, spec, prompt_key: str, answer_key: str, prompt_format: str | None) -> PromptSet:
    try:
        return load_prompts(spec, prompt_key=prompt_key, answer_key=answer_key, prompt_format=prompt_format)
    except PromptFileError as err:
        raise PromptFileError(f"{field}: {err}") from None


@refusal
def check_before_torch(cfg: RunConfig, world: int) -> None:
    """The checks that need neither torch nor megatron-core (the command line makes them first)."""
    hf = load_hf_config(check_model_dir(cfg))
    # An MoE config names its expert count (hf_config normalises the families' aliases to
    # num_experts); the family table, which imports megatron-core, decides it in check_inputs.
    dims = model_dims(hf, str(hf.get("model_type")), moe=hf.get("num_experts") is not None)
    cfg.parallel.validate_model(**dims)
    if cfg.compute.transformer_engine is False or importlib.util.find_spec("transformer_engine") is None:
        # a sure "no" for context parallelism; with TE installed check_inputs asks CUDA too
        cfg.parallel.check_context_parallel(transformer_engine=False, cuda=False, half=False)
    cfg.parallel.validate(world, **dims)
    if cfg.distill.teacher:
        check_model_folder("distill.teacher", cfg.distill.teacher)
    check_prompts(cfg)
    check_sync(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # the rank that takes the locks; another rank could
        # see its own rank 0's lock, taken meanwhile
        check_run_folders_unlocked(cfg)  # RunLockedError: another live run holds a folder


def check_sync(cfg: RunConfig) -> None:
    """sync.delta=true on a transport that cannot carry deltas (the TRANSPORTS table)."""
    row = TRANSPORTS[cfg.sync.transport]
    if cfg.sync.delta and not row.deltas:
        able = ", ".join(n for n, r in TRANSPORTS.items() if r.deltas)
        raise ConfigError(f"sync.delta=true: the {row.name} transport carries whole tensors only; set "
                          f"sync.delta to null (deltas where the transport can) or false, or choose a "
                          f"sync.transport that carries them ({able})")


@dataclasses.dataclass
class Inputs:
    """What check_inputs established about the run's inputs."""
    model_fingerprint: dict[str, Any]     # what the run's derived state must have been made from
    resume_from: Path | None              # the complete, verified checkpoint to resume from
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt set's fingerprint
    new_prompt_epoch: bool = False        # resume over a changed prompt set: start a new epoch
    prompt_rows: KeptRows | None = None   # rank 0, rollout.max_prompt_tokens: the rows kept


@refusal
def check_inputs(cfg: RunConfig, world: int) -> Inputs:
    """Cheap checks every rank makes before anything is written or started: the model directory
    (config, layout against the world size and the model, context parallelism and packing on this
    machine, weight files, tokenizer), the prompt set, the teacher, the environment or reward, the
    output folders, the initial checkpoint, and the checkpoint a resume would load."""
    from gspo_megatron.actor.batching.packing import resolve_sequence_layout
    from gspo_megatron.actor.settings import Available
    from gspo_megatron.checkpoint.fingerprint import describe_change, model_fingerprint, read_fingerprint
    from gspo_megatron.checkpoint.loop_state import load_driver_state
    from gspo_megatron.checkpoint.manager import CheckpointError, CheckpointManager
    from model_specs import load_hf_config, model_dims_for
    from rollout.prompts.sets import prompt_set_fingerprint
    hf = check_model_dir(cfg)
    dims = model_dims_for(load_hf_config(hf))
    cfg.parallel.validate_model(**dims)  # what holds at any world size first, then the world size
    available = Available.detect()
    try:
        compute = cfg.compute.resolve(available)  # a kernel this machine lacks: named now
    except ValueError as e:
        raise ConfigError(f"compute.{e}") from None
    try:
        cfg.train.check_machine(available)  # optimizer offload without CUDA
    except ValueError as e:
        raise ConfigError(f"train.{e}") from None
    if "linear_num_key_heads" in dims:  # Gated DeltaNet: kernels that would refuse its backward
        available.check_gated_delta_net()
    try:  # the Actor resolves it with the same function: what this says is what it builds
        resolve_sequence_layout(cfg.parallel, cfg.train.pack_sequences,
                                transformer_engine=bool(compute.transformer_engine), cuda=available.cuda,  # resolved
                                half=cfg.model.dtype == "bfloat16", te_version=available.te_version,
                                linear_attention="linear_num_key_heads" in dims)
    except LayoutError:
        raise
    except ValueError as e:
        raise ConfigError(f"train.{e}") from None
    cfg.parallel.validate(world, **dims)
    fingerprint = model_fingerprint(hf)  # reads every weight file's header: DamagedFileError names it
    if not any((hf / n).is_file() for n in TOKENIZER_FILES):
        raise MissingInputError(f"model.hf_path={str(hf)!r}: no tokenizer there (none of "
                                f"{', '.join(TOKENIZER_FILES)})")
    check_served_here(cfg, hf, cuda=available.cuda)  # SGLang cannot serve every model on a CPU
    train_set, held_out = check_prompts(cfg)  # PromptFileError names the file, the row and the key
    check_sync(cfg)
    r = cfg.rollout
    prompts = prompt_set_fingerprint(train_set.files(), train_set.total_rows, selection={
        "prompt_key": r.prompt_key, "answer_key": r.answer_key, "max_prompt_tokens": r.max_prompt_tokens})
    kept = None
    if int(os.environ.get("RANK", "0")) == 0:  # the driver's rows: each prompt and its response fit the
        check_prompts_fit(cfg, train_set, held_out, hf)  # context, with max_prompt_tokens (its bound) or not
    if r.max_prompt_tokens and int(os.environ.get("RANK", "0")) == 0:
        kept = drop_overlong_prompts(cfg, train_set, hf)
    if cfg.distill.teacher:  # before any server starts: it loads, and reads the student's tokens
        check_teacher(cfg, hf)
    if cfg.rollout.environment:
        from gspo_megatron.driver.environment import env_factory
        env_factory(cfg.rollout)  # EnvironmentSpecError names a bad name, module, class or args
    else:
        from rollout.rewards.registry import check_reward
        rewards = [(r.reward, r.reward_args), (cfg.eval.reward or r.reward, cfg.eval_reward_args())]
        for reward, args in rewards[:1] if rewards[1] == rewards[0] else rewards:
            # an unknown name, a module:function that fails, no sandbox, a service that is down
            note = check_reward(reward, args)
            if note and int(os.environ.get("RANK", "0")) == 0:
                print(f"[gspo] {note}", flush=True)
    if cfg.model.megatron_checkpoint and not (Path(cfg.model.megatron_checkpoint) / "metadata.json").is_file():
        where = f"model.megatron_checkpoint={resolved(cfg.model.megatron_checkpoint)}"
        if Path(cfg.model.megatron_checkpoint).is_file():
            raise MissingInputError(f"{where} is a file, not a folder (expected a megatron "
                                    "dist_checkpointing directory)")
        raise MissingInputError(f"{where}: not a megatron dist_checkpointing directory (no metadata.json)")
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
        if cfg.loss.reference_reason and cfg.checkpoint.dir and not cfg.lora.enabled:  # a LoRA run's is its base
            ref = Path(cfg.checkpoint.dir) / REFERENCE_DIR
            if not (ref / "model.safetensors").is_file():
                raise ConfigError(f"{cfg.loss.reference_reason}: resuming from {resume_from}, "
                                  f"but {ref / 'model.safetensors'} (the KL reference of this run) does "
                                  "not exist; was the run started with kl_coef=0? Start a new run "
                                  "(new checkpoint.dir)")
            change = describe_change(read_fingerprint(ref)[1], fingerprint)
            if change and "no record" not in change:
                raise CheckpointError(f"{ref} (the KL reference) was made from another model than "
                                      f"model.hf_path={str(hf)!r} ({change}); start a new run")
    return Inputs(fingerprint, resume_from, prompts, new_epoch, kept)


def checkpoint_bytes(cfg: RunConfig, hf_dir: Path) -> int:
    """About one training checkpoint: parameters in the training dtype, plus the optimizer's
    fp32 state (Adam's two moments, and an fp32 master copy of 16-bit parameters)."""
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.param_count import param_count
    n = param_count(spec_for_layout(hf_dir, ParallelLayout())).total
    half = cfg.model.dtype == "bfloat16"
    per_param = (2 if half else 4) + (8 if cfg.train.optimizer == "adam" else 0) + (4 if half else 0)
    return n * per_param


def check_outputs(cfg: RunConfig, hf_dir: Path, previous_checkpoint_bytes: int | None = None,
                  resuming: bool = False) -> None:
    """OutputDirError (one line) for an output the run could not write, or lack room for: one
    checkpoint (the last one's size, else estimated), plus the initial HF -> megatron conversion
    when a fresh run makes one (into checkpoint.dir: about the weight files' size), plus the weight
    sync's copies (a folder transport) where they share the checkpoint's filesystem."""
    for field, path in output_fields(cfg).items():
        check_writable_dir(field, path)
    if cfg.checkpoint.export_hf:
        check_export_target("checkpoint.export_hf", cfg.checkpoint.export_hf, **export_rules(cfg))
    if cfg.lora.export_peft:
        check_export_target("lora.export_peft", cfg.lora.export_peft, **export_rules(cfg))
    if cfg.lora.init_peft:
        from gspo_megatron.lora.peft import load_peft
        load_peft(cfg.lora.init_peft)  # the folder and its files (their shapes: when loaded)
    needs: list[tuple[str, str | Path, int, str]] = []  # (field, path, bytes, what): one filesystem's fit together
    if cfg.checkpoint.dir:
        need = previous_checkpoint_bytes or checkpoint_bytes(cfg, hf_dir)
        what = ("one checkpoint (the last one's size)" if previous_checkpoint_bytes
                else "one checkpoint (parameters + optimizer state, estimated from the model)")
        if not resuming and not cfg.model.megatron_checkpoint:
            from gspo_megatron.checkpoint.hf_files import weight_files
            need += sum(f.stat().st_size for f in weight_files(hf_dir))
            what = "the initial conversion and " + what
        needs.append(("checkpoint.dir", cfg.checkpoint.dir, need, what))
    row = TRANSPORTS[cfg.sync.transport]
    if row.folder_versions and not cfg.lora.enabled:  # the versions the transport keeps in sync.dir
        # at once (a LoRA run's adapters go through no transport: sync/adapter_sync.py)
        from gspo_megatron.checkpoint.hf_files import weight_files
        need = row.folder_versions * sum(f.stat().st_size for f in weight_files(hf_dir))
        needs.append(("sync.dir", cfg.sync.dir or Path(run_root(cfg)) / "sync", need,
                      f"the {row.name} transport ({row.folder_versions} copies of the model's weights)"))
    check_free_space_together(needs)


def prompt_set_changed(stored: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """'' when the sets are the same (a moved file with the same bytes is the same set)."""
    if not stored:
        return ""
    if (stored.get("sha256"), stored.get("records")) == (now["sha256"], now["records"]):
        return ""
    return (f"the checkpoint's set was {', '.join(stored.get('paths', []))} ({stored.get('records')} "
            f"records, {stored.get('bytes')} bytes, sha256 {str(stored.get('sha256'))[:12]}), now "
            f"{', '.join(now['paths'])} ({now['records']} records, {now['bytes']} bytes, sha256 "
            f"{now['sha256'][:12]})")


def check_prompt_set(cfg: RunConfig, stored: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    """On resume: True when the prompt set changed and rollout.prompts_changed=restart_epoch says
    to start a new epoch over it; ConfigError (one line) when it changed and the run refuses."""
    change = prompt_set_changed(stored, now)
    if not change:
        return False
    if cfg.rollout.prompts_changed == "restart_epoch":
        print(f"[gspo] rollout.prompts changed since the checkpoint ({change}): a new epoch over "
              "the new set starts (rollout.prompts_changed=restart_epoch)", flush=True)
        return True
    raise ConfigError(f"rollout.prompts={cfg.rollout.prompts!r} is not the prompt set the run in "
                      f"checkpoint.dir={cfg.checkpoint.dir!r} was trained on ({change}); resume with "
                      "that set, or set rollout.prompts_changed=restart_epoch to start a new epoch "
                      "over this one")


def drop_overlong_prompts(cfg: RunConfig, prompts: PromptSet, hf_dir: Path) -> KeptRows:
    """rollout.max_prompt_tokens: the rows kept (an index array), said in one line."""
    from transformers import AutoTokenizer

    from rollout.prompts.dataset import PromptFileError, filter_overlong
    r = cfg.rollout
    if r.max_prompt_tokens is None:
        raise ValueError("dropping overlong prompts needs rollout.max_prompt_tokens")
    try:
        kept, dropped = filter_overlong(prompts, AutoTokenizer.from_pretrained(str(hf_dir)), r.max_prompt_tokens)
    except PromptFileError as e:
        raise PromptFileError(f"rollout.prompts={r.prompts!r}: {e}") from None
    print(f"[gspo] rollout.prompts: {dropped} of {prompts.total_rows} prompts are longer than "
          f"{r.max_prompt_tokens} tokens (rollout.max_prompt_tokens) and were dropped; {len(kept)} remain",
          flush=True)
    if kept.kept is None:
        raise RuntimeError("filter_overlong returned every row without a kept-row index")
    return kept.kept
