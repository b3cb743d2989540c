"""Save and load the model's weights as a megatron dist_checkpointing checkpoint, any layout.

    save_model(model_chunks, ckpt_dir, hf_dir=hf_dir)   # collective: every trainer rank calls it
    load_model(model_chunks, ckpt_dir)                  # the same checkpoint under any TP/PP/EP/VPP

Checkpoint keys are those of GPTModel.sharded_state_dict() (global layer and expert indices, TE-style
norm names whatever the backend), so a checkpoint written under one layout (or by
tools/convert_hf_to_megatron.py in one process) loads under any other layout the model allows.
Linear layers' extra state (Transformer Engine FP8 metadata; empty with the local spec; see
`is_extra_state`) is not part of a model checkpoint. The HF config and tokenizer files ride along in `<ckpt>/hf/` so the
checkpoint can be exported back to HF (tools/convert_megatron_to_hf.py) without the source model.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from gspo_megatron.checkpoint.hf_files import DamagedFileError, copy_metadata_files
from gspo_megatron.lora.adapters import is_adapter_key
from gspo_megatron.parallel.layout import LayoutError, ParallelLayout
from gspo_megatron.parallel.model_chunks import unwrap  # DDP / Float16Module prefix names with 'module.'
from gspo_errors import InputError, MissingInputError
from model_specs import model_dims_for
from model_specs.hf.config import normalize_hf_config

HF_SUBDIR = "hf"
MANIFEST = "MANIFEST.json"  # a training checkpoint's files and sizes (checkpoint/manager.py)


class _OwnFolderFilter(logging.Filter):
    """megatron's save warns "Overwriting old incomplete / corrupted checkpoint..." whenever the
    folder is not empty (megatron-core 0.16 and 0.19 dist_checkpointing/serialization.py save).
    Ours never is: the HF files go into `hf/` first, into a folder made for this save (checkpoints
    and conversions are written beside their place and renamed in), so the warning is never true."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete / corrupted checkpoint" not in record.getMessage()


logging.getLogger("megatron.core.dist_checkpointing.serialization").addFilter(_OwnFolderFilter())
# `_extra_state`, and TE's grouped linear's per-GEMM `_extra_state1`, `_extra_state2`, ... as the
# last component of a (possibly nested) state-dict key.
_EXTRA_STATE_RE = re.compile(r"(?:^|\.)_extra_state\d*$")


def is_extra_state(key: str) -> bool:
    """A Transformer Engine module's extra state (FP8 scaling metadata), never a weight.

    A grouped linear (grouped-GEMM experts) names GEMM 0's `{prefix}_extra_state` and GEMM i's
    `{prefix}_extra_state{i}` in its sharded state dict, all shards of one ShardedObject key
    (megatron/core/extensions/transformer_engine.py, TEGroupedLinear._sharded_state_dict_grouped
    and merge_extra_states). Matching only the `_extra_state` suffix dropped GEMM 0's shard and
    kept the others: "1 ShardedObject are missing" at every save and load with grouped GEMM on an
    H100 (docs/results.md; Megatron-LM PR 6509, NeMo-RL issues 1053 and 1128 are the same class)."""
    return _EXTRA_STATE_RE.search(key) is not None


def without_extra_state(sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` without its extra-state entries (by dict key, and by sharded key for ShardedBase values)."""
    return {k: v for k, v in sd.items()
            if not is_extra_state(k) and not is_extra_state(getattr(v, "key", ""))}


class CheckpointMismatchError(InputError, ValueError):
    """A checkpoint that does not fit the model: the message names the tensors and shapes."""


def model_sharded_state_dict(models: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """{"model0": ..., "model1": ...} (one per virtual-pipeline chunk), without `_extra_state`
    and without LoRA adapters (the base model's checkpoint; adapters are checkpointed apart)."""
    out = {}
    for i, m in enumerate(models):
        sd = unwrap(m).sharded_state_dict()
        out[f"model{i}"] = {k: v for k, v in without_extra_state(sd).items() if not is_adapter_key(k)}
    return out


class TorchDcpSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's torch_dist format, written synchronously by torch's own FileSystemWriter.

    megatron's default writer starts a multiprocessing Manager for its async queue, which fails in
    daemonic processes (test launchers, some job wrappers) and needs a __main__ guard; the files
    and metadata written here are the same format and load with megatron's default strategy.
    Subclasses can supply a planner (the HF converter resolves tensors lazily)."""

    def __init__(self, single_file_per_rank: bool = True) -> None:
        super().__init__("torch_dist", 1)
        self.single_file_per_rank = single_file_per_rank

    def make_planner(self, by_key, flat_mapping, rename_mapping) -> MCoreSavePlanner:
        return MCoreSavePlanner(flatten_state_dict=False)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        by_key, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True)
        planner = self.make_planner(by_key, flat_mapping, rename_mapping)
        dcp_save(mcore_to_pyt_state_dict(by_key, False),
                 storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                 single_file_per_rank=self.single_file_per_rank),
                 planner=planner)


def save_model(models: Sequence[torch.nn.Module], ckpt_dir: str | Path,
               hf_dir: str | Path | None = None) -> None:
    """Collective. Writes the model weights (and, from rank 0, the HF metadata files of hf_dir)."""
    ckpt_dir = Path(ckpt_dir)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if hf_dir is not None:
            copy_metadata_files(hf_dir, ckpt_dir / HF_SUBDIR)
    dist.barrier()
    dist_checkpointing.save(model_sharded_state_dict(models), str(ckpt_dir),
                            sharded_strategy=TorchDcpSaveStrategy())


def _load_model_chunks(chunks: Sequence[torch.nn.Module], state: dict, path: str | Path) -> None:
    """Each chunk's `model{i}` entry of a loaded checkpoint, strictly (TE's _extra_state aside)."""
    for i, c in enumerate(chunks):
        missing, unexpected = unwrap(c).load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not is_extra_state(k) and not is_adapter_key(k)]
        if missing or unexpected:
            raise CheckpointMismatchError(f"loading {path} into model chunk {i}: missing {missing}, "
                                          f"unexpected {unexpected}")


def load_model(models: Sequence[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Collective. Loads the weights into the model chunks, whatever layout wrote them."""
    check_is_checkpoint(ckpt_dir)
    check_matches(model_sharded_state_dict(models), ckpt_dir)
    loaded = dist_checkpointing.load(model_sharded_state_dict(models), str(ckpt_dir))
    _load_model_chunks(models, loaded, ckpt_dir)


def check_is_checkpoint(ckpt_dir: str | Path) -> None:
    """MissingInputError / DamagedFileError naming what makes `ckpt_dir` unloadable before
    dist_checkpointing reads it (its own errors are a per-rank traceback naming no file, or
    "'str' object has no attribute 'iterdir'" for a missing common.pt): a file given for the folder,
    a training checkpoint's step folder given for its model/, no metadata.json, common.pt or
    .metadata, and a shard missing or shorter than its manifest (MANIFEST.json, of a training
    checkpoint) or the .metadata index says."""
    path = Path(ckpt_dir)
    if path.is_file():
        raise MissingInputError(f"{path} is a file, not a folder (expected a megatron dist_checkpointing "
                                "checkpoint directory)")
    if not (path / "metadata.json").is_file():
        raise MissingInputError(f"{path} is not a megatron dist_checkpointing checkpoint "
                                f"(no metadata.json){_where_the_model_is(path)}")
    if not (path / ".metadata").is_file():
        raise MissingInputError(f"checkpoint {path} is incomplete: {path / '.metadata'} (torch's index of "
                                "the shards, written by every dist_checkpointing save) is missing")
    if not (path / "common.pt").is_file() and not _common_state_in_shards(path):
        raise MissingInputError(f"checkpoint {path} is incomplete: {path / 'common.pt'} (megatron's common "
                                "state, which this checkpoint's index does not hold either) is missing")
    _check_shard_sizes(path)


def _common_state_in_shards(path: Path) -> bool:
    """Whether megatron's common state is a sharded object in the torch_dist shards (the format of
    megatron-core 0.17 and later: dist_checkpointing.serialization.load_common_state_dict reads a
    legacy common.pt where there is one, else the "common_state" object) rather than common.pt."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - a damaged index is named by _check_shard_sizes
        return True
    return any(k.startswith("common_state") for k in keys)


def _where_the_model_is(path: Path) -> str:
    """Where the model of a training checkpoint's folder is, said after "not a checkpoint"."""
    if (path / "model" / "metadata.json").is_file():
        return f"; this is a training checkpoint's step folder: its model is {path / 'model'}"
    latest = path / "latest"
    if latest.is_file():
        step = latest.read_bytes().decode(errors="replace").strip()
        if (path / step / "model" / "metadata.json").is_file():
            return f"; this is a run's checkpoint.dir: the model of its latest step is {path / step / 'model'}"
    return ""


def _check_shard_sizes(path: Path) -> None:
    """The first shard that is missing or short, by the training checkpoint's manifest (in the
    step folder above model/) where there is one, else by the .metadata index: each stored
    piece's (file, offset, length)."""
    from torch.distributed.checkpoint import FileSystemReader
    sizes = _manifest_sizes(path)
    says = f"{path.parent / MANIFEST} says {{}} bytes"
    if sizes is None:
        says = f"{path / '.metadata'} places data up to byte {{}}"
        try:
            storage = FileSystemReader(str(path)).read_metadata().storage_data
        except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: the file is damaged
            raise DamagedFileError(f"checkpoint {path} is damaged: {path / '.metadata'} cannot be read "
                                   f"({type(e).__name__}: {e})") from None
        sizes = {}
        for item in storage.values():
            sizes[item.relative_path] = max(sizes.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(sizes.items()):
        f = path / name
        if not f.is_file():
            raise MissingInputError(f"checkpoint {path} is damaged: {f} is missing ({says.format(size)})")
        if f.stat().st_size < size:
            raise DamagedFileError(f"checkpoint {path} is damaged: {f} is truncated ({f.stat().st_size} "
                                   f"bytes; {says.format(size)})")


def _manifest_sizes(path: Path) -> dict[str, int] | None:
    """{file name: bytes} of the model files of a training checkpoint's manifest (model/ of the step
    folder holding MANIFEST.json, checkpoint/manager.py), or None without one."""
    manifest = path.parent / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MissingInputError(f"{manifest} is damaged ({type(e).__name__}: {e})") from None
    prefix = f"{path.name}/"
    return {k[len(prefix):]: int(v) for k, v in files.items()
            if k.startswith(prefix) and "/" not in k[len(prefix):] and not k.startswith(f"{prefix}{HF_SUBDIR}/")}


def checkpoint_hf_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """The HF config stored with the checkpoint (normalised field names)."""
    path = Path(ckpt_dir) / HF_SUBDIR / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{path} not found: the checkpoint was saved without its HF config "
                                "(save_model(..., hf_dir=...) or tools/convert_hf_to_megatron.py)")
    return normalize_hf_config(json.loads(path.read_text()))


def check_layout_fits(ckpt_dir: str | Path, layout: ParallelLayout, world_size: int) -> None:
    """Raise CheckpointMismatchError if the checkpoint's model cannot be loaded (resharded) under
    `layout` on `world_size` ranks; call it before building the model or any collective."""
    try:
        layout.validate(world_size, **model_dims_for(checkpoint_hf_config(ckpt_dir)))
    except LayoutError as e:
        raise CheckpointMismatchError(f"checkpoint {ckpt_dir} cannot be resharded to "
                                      f"{layout.describe(world_size)}: {e}") from None


def expected_tensors(sharded_sd: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint key -> (global shape, dtype) that loading `sharded_sd` needs."""
    out = {}

    def visit(v: Any) -> None:
        if isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, list):
            for x in v:
                visit(x)
        elif isinstance(v, ShardedTensorFactory):
            visit(v.build())
        elif isinstance(v, ShardedTensor):
            out[v.key] = (tuple(v.global_shape), v.dtype)

    visit(sharded_sd)
    return out


def check_matches(sharded_sd: dict[str, Any], ckpt_dir: str | Path) -> None:
    """Raise CheckpointMismatchError naming every tensor the checkpoint lacks or has another
    global shape for (a checkpoint of another model, or a config that does not match it)."""
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    problems = []
    for key, (shape, _) in sorted(expected_tensors(sharded_sd).items()):
        if key not in stored:
            problems.append(f"{key}: missing from the checkpoint")
        elif tuple(stored[key].global_shape) != shape:
            problems.append(f"{key}: global shape {tuple(stored[key].global_shape)} in the "
                            f"checkpoint, the model expects {shape}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointMismatchError(f"checkpoint {ckpt_dir} does not match the model "
                                      f"(another model, or a config/checkpoint mismatch):\n  "
                                      f"{shown}{more}")


# --- model + optimizer (the Actor's part of a training checkpoint) ----------------------------
def _sharded_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    sd = model_sharded_state_dict(chunks)  # {"model0": ..., ...}: the model checkpoint format
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return sd


def save_model_and_optimizer(path: Path, chunks: list, optimizer) -> None:
    """Collective: every rank writes its shards of the model (+ optimizer) into `path`.

    The model part is exactly save_model's format, so a training checkpoint's model/ also loads
    with load_model and exports with convert_megatron_to_hf (given its hf/ metadata files)."""
    if dist.get_rank() == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), str(path),
                            sharded_strategy=TorchDcpSaveStrategy())


def ensure_optimizer_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet has no state to load into (megatron asserts
    on the missing Adam 'step' without TE/apex): give it dummy state, as megatron does for its
    fsdp path; the load below overwrites all of it, and the model weights too."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and not sub.optimizer.state:
            sub._init_optimizer_states_with_dummy_values()


def load_model_and_optimizer(path: Path, chunks: list, optimizer) -> None:
    """Collective: load model (+ optimizer) shards for this rank's layout from `path`."""
    check_is_checkpoint(path)
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
    check_matches(model_sharded_state_dict(chunks), path)
    state = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True), str(path))
    _load_model_chunks(chunks, state, path)
    if optimizer is not None:
        # The fp32 distributed optimizer copies into leaf params in load_state_dict (ENVIRONMENT #11).
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        unshare_adam_steps(optimizer)


def unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 bug (distrib_optimizer.py load_state_dict, non-TE/apex path): one
    `step` tensor object is put into every parameter's Adam state; torch's Adam increments it in
    place once per parameter, so after a resume the bias correction is wrong (the continued run
    drifts by ~lr per step). Give every parameter its own copy."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if isinstance(st, dict) and torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
