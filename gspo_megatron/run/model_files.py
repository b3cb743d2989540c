"""The model files a run derives from its inputs, each written whole or not at all: the initial
megatron checkpoint (HF converted once), the KL reference, the final policy's megatron checkpoint
and its HF export.

    init = initial_megatron_checkpoint(cfg, rank, fingerprint)   # rank 0 converts; every rank reads
    set_up_reference(run)                                        # loss.kl_coef > 0, after warm start
    src = final_model_checkpoint(run)                            # collective
    export_hf(src, cfg)                                          # rank 0, after the process groups
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from gspo_megatron.config import RunConfig
from gspo_megatron.run.folders import INITIAL_DIR, REFERENCE_DIR, export_rules, scratch_dir

if TYPE_CHECKING:
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager


class RunParts(Protocol):
    """What the reference and the final checkpoint are made from: a setup.Run's parts (setup.py
    imports this module, so it names them rather than the Run)."""

    cfg: RunConfig
    rank: int
    actor: Actor
    ckpt: CheckpointManager | None
    loop: LoopState
    resumed_from: Path | None


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
                # (torch.distributed.checkpoint.api); a full disk becomes one line, the rest re-raised
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


def set_up_reference(run: RunParts) -> None:
    """The KL reference is the policy RL starts from (after the warm start). It is saved once, to
    checkpoint.dir/reference/model.safetensors (one-process tensors, rank 0, atomic), so that a
    resumed run, in any layout, penalises against the same policy. A LoRA run's is its base (the
    adapters off): nothing to save."""
    from safetensors.torch import load_file, save_file
    if run.cfg.lora.enabled:
        run.actor.set_reference()
        return
    ckpt_dir = run.cfg.checkpoint.dir if run.ckpt else None
    path = Path(ckpt_dir) / REFERENCE_DIR / "model.safetensors" if ckpt_dir else None
    if run.resumed_from is not None and path is not None:  # preflight found it, of the same model
        run.actor.set_reference(load_file(str(path)))
        return
    run.actor.set_reference()
    if path is None:
        return
    from gspo_megatron.checkpoint.fingerprint import write_fingerprint
    full = run.actor.full_state_dict(to_all_ranks=False)
    if full is not None:  # rank 0: the directory appears complete (weights + source) or not at all
        tmp = path.parent.with_name(path.parent.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / path.name))
        write_fingerprint(tmp, run.loop.extra["source_model"], run.cfg.model.hf_path)
        shutil.rmtree(path.parent, ignore_errors=True)
        os.rename(tmp, path.parent)
    dist.barrier()


def final_model_checkpoint(run: RunParts) -> Path:
    """Collective. A megatron checkpoint of the current policy: the last checkpoint's model if
    it is of this step, else a fresh model-only checkpoint in a scratch directory (a LoRA run's
    always: the base with its adapters merged in, lora/merge.py merged_in_place)."""
    import contextlib

    from gspo_megatron.checkpoint.model_io import save_model
    from gspo_megatron.lora.merge import merged_in_place
    lora = run.cfg.lora.enabled
    latest = run.ckpt.latest() if run.ckpt else None
    if not lora and latest is not None and latest.name.endswith(f"{run.loop.step:08d}"):
        return latest / "model"
    src = scratch_dir(run.cfg, "final_megatron")
    if run.rank == 0 and src.exists():
        shutil.rmtree(src)
    dist.barrier()
    with merged_in_place(run.actor.models) if lora else contextlib.nullcontext():
        save_model(run.actor.models, src, hf_dir=run.cfg.model.hf_path)
    dist.barrier()
    return src


def load_peft_adapters(actor: Actor, cfg: RunConfig) -> None:
    """Collective: the adapters of the PEFT folder lora.init_peft (lora/peft.py from_peft)."""
    from gspo_megatron.lora.peft import from_peft, load_peft
    from model_specs import load_hf_config
    from model_specs.weights.maps import weight_map_for
    if cfg.lora.init_peft is None:
        raise ValueError("load_peft_adapters without lora.init_peft")
    expected = actor.full_adapter_state_dict()
    if expected is None:
        raise RuntimeError("full_adapter_state_dict(to_all_ranks=True) gave this rank nothing")
    tensors, config = load_peft(cfg.lora.init_peft)
    actor.load_full_adapter_state_dict(from_peft(tensors, config, weight_map_for(load_hf_config(cfg.model.hf_path)),
                                                 expected, cfg.lora, where=f"lora.init_peft={cfg.lora.init_peft}"))


def export_peft(run: Any) -> Path | None:
    """Collective: the final adapters as a PEFT folder at lora.export_peft (rank 0 writes it,
    published whole like checkpoint.export_hf); None on the other ranks."""
    from gspo_megatron.checkpoint.output_dirs import publish_dir
    from gspo_megatron.lora.peft import peft_config, save_peft, to_peft
    from model_specs.weights.maps import weight_map_for
    full = run.actor.full_adapter_state_dict(to_all_ranks=False)
    if run.rank != 0:
        return None
    tensors = to_peft(full, weight_map_for(run.actor.spec.hf_config))
    rules = export_rules(run.cfg)
    out = publish_dir(run.cfg.lora.export_peft, lambda tmp: save_peft(tmp, tensors, peft_config(run.cfg.lora, tensors)),
                      field="lora.export_peft", protected=rules["protected"], may_hold=rules["may_hold"])
    print(f"[gspo] exported the final adapters to {out} (PEFT, SGLang's names)", flush=True)
    return out


def export_hf(src: Path, cfg: RunConfig) -> None:
    """The final policy as HF safetensors (rank 0, after the process groups are gone), published
    whole into checkpoint.export_hf: it replaces only an earlier export (output_dirs)."""
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    if cfg.checkpoint.export_hf is None:
        raise ValueError("export_hf without checkpoint.export_hf")
    rules = export_rules(cfg)
    convert_megatron_to_hf(src, cfg.checkpoint.export_hf, field="checkpoint.export_hf",
                           protected=rules["protected"], may_hold=rules["may_hold"])
    print(f"[gspo] exported the final policy to {cfg.checkpoint.export_hf} (HF format)", flush=True)
