"""A LoRA run's checkpoint: the adapters and their optimizer state in dist_checkpointing, the base by
reference.

    save_adapters_and_optimizer(path, chunks, optimizer, base=BaseReference.of(base_ckpt))
    load_adapters_and_optimizer(path, chunks, optimizer, base=BaseReference.of(base_ckpt))

The model part holds every adapter under its global name (`decoder.layers.{l}....lora.a`) as a
sharded tensor cut the way the adapter is cut in this layout, so megatron's dist_checkpointing
reshards it on load like the base's weights (TP: B like its base's rows, the gated fc1's [gate;
up] halves apart as megatron's own apply_swiglu_sharded_factory stores them; A of a row-parallel
base by its columns; EP: the experts' stacked tensors by their expert dimension). The optimizer
part is megatron's own sharded optimizer state of those parameters (optimizer.sharded_state_dict).
RNG and the loop's state are the step checkpoint's, as for full fine-tuning (manager.py).

The base is never written again: `base.json` beside the shards names the megatron checkpoint the
base came from and the size and CRC32 of each of its files. A resume loads that base first and
is refused when its files are not those (another model, or a base changed in place).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from gspo_megatron.checkpoint.model_io import (CheckpointMismatchError, TorchDcpSaveStrategy, check_is_checkpoint,
                                               ensure_optimizer_state, unshare_adam_steps)
from gspo_megatron.lora.attach import named_adapters
from gspo_megatron.parallel.model_chunks import unwrap

BASE_FILE = "base.json"


@dataclass
class BaseReference:
    """The megatron checkpoint a LoRA run's base was loaded from: its path and its files' sizes and
    CRC32s (what makes it that base)."""

    path: str
    files: dict[str, int] = field(default_factory=dict)
    crc32: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, ckpt_dir: str | Path) -> BaseReference:
        """The reference of a checkpoint folder: one read of every file (the CRC runs at about
        4.6 GB/s: 13 s for Qwen3-30B-A3B's 61 GB in bf16)."""
        from gspo_megatron.checkpoint.manager import file_crc32
        root = Path(ckpt_dir).resolve()
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return cls(str(root), {str(p.relative_to(root)): p.stat().st_size for p in files},
                   {str(p.relative_to(root)): f"{file_crc32(p):08x}" for p in files})

    def differs(self, other: BaseReference) -> str:
        """"" when both name the same files with the same bytes, else what differs (one line)."""
        if self.files != other.files:
            changed = sorted(set(self.files) ^ set(other.files)) or sorted(
                k for k in self.files if self.files[k] != other.files.get(k))
            return f"its files differ ({', '.join(changed[:3])})"
        wrong = sorted(k for k in self.crc32 if self.crc32[k] != other.crc32.get(k))
        return f"the bytes of {', '.join(wrong[:3])} differ (CRC32)" if wrong else ""


_REFERENCES: dict[str, BaseReference] = {}


def base_reference(ckpt_dir: str | Path | None) -> BaseReference:
    """Collective: BaseReference.of(ckpt_dir), read once by rank 0 and handed to every rank, kept
    for the process (the base never changes)."""
    if ckpt_dir is None:
        raise CheckpointMismatchError("a LoRA checkpoint names its base by reference: load the base with "
                                      "Actor.load_weights(checkpoint) first")
    key = str(Path(ckpt_dir).resolve())
    if key not in _REFERENCES:
        got: list[BaseReference | None] = [BaseReference.of(key) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(got, src=0)
        if got[0] is None:
            raise RuntimeError("base_reference: rank 0 sent no reference")
        _REFERENCES[key] = got[0]
    return _REFERENCES[key]


def _dp_rank() -> int:
    return ps.get_data_parallel_rank(with_context_parallel=True)


def _sharded(param: torch.nn.Parameter, key: str) -> Any:
    """The sharded tensor (or factory) of one adapter parameter in this layout (module docstring)."""
    if getattr(param, "expert_stacked", False):
        return ShardedTensor.from_rank_offsets(
            key, param, (0, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
            replica_id=(0, 0, ps.get_expert_data_parallel_rank()))
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return ShardedTensor.from_rank_offsets(key, param, replica_id=(0, tp_rank, _dp_rank()))
    dim, stride = getattr(param, "partition_dim"), getattr(param, "partition_stride", 1)
    sh = ShardedTensor.from_rank_offsets(key, param, (dim, tp_rank, tp), replica_id=(0, 0, _dp_rank()))
    if stride == 1:
        return sh
    if stride != 2 or dim != 0:
        raise ValueError(f"{key}: a TP split with partition_stride={stride} along dim {dim} has no "
                         "checkpoint layout here (only a gated fc1's [gate; up] rows)")
    return apply_swiglu_sharded_factory(sh, ())


def adapter_sharded_state_dict(models: Sequence[torch.nn.Module]) -> dict[str, dict[str, Any]]:
    """{"model0": {local state-dict key: sharded tensor}, ...}: the adapters of each chunk."""
    return {f"model{i}": {local: _sharded(param, name) for local, name, param in named_adapters(unwrap(m))}
            for i, m in enumerate(models)}


def _state(chunks: Sequence[torch.nn.Module], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    sd: dict[str, Any] = adapter_sharded_state_dict(chunks)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return sd


def save_adapters_and_optimizer(path: Path, chunks: Sequence[torch.nn.Module], optimizer: Any,
                                base: BaseReference) -> None:
    """Collective: every rank writes its shards of the adapters (and optimizer) into `path`; rank 0
    writes the base's reference beside them."""
    if dist.get_rank() == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / BASE_FILE).write_text(json.dumps(asdict(base), indent=1) + "\n")
    dist.barrier()
    dist_checkpointing.save(_state(chunks, optimizer, is_loading=False), str(path),
                            sharded_strategy=TorchDcpSaveStrategy())


def saved_base(path: Path) -> BaseReference:
    """The base reference a LoRA checkpoint was saved with."""
    try:
        return BaseReference(**json.loads((Path(path) / BASE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointMismatchError(f"{Path(path) / BASE_FILE}: the LoRA checkpoint's base reference "
                                      f"cannot be read ({type(e).__name__}: {e})") from None


def is_adapter_checkpoint(path: Path) -> bool:
    return (Path(path) / BASE_FILE).is_file()


@torch.no_grad()
def load_adapters_and_optimizer(path: Path, chunks: Sequence[torch.nn.Module], optimizer: Any,
                                base: BaseReference) -> None:
    """Collective: the adapters (and optimizer) saved under any layout into this one. The base
    must be loaded already, and be the one the checkpoint names (CheckpointMismatchError)."""
    check_is_checkpoint(path)
    saved = saved_base(path)
    why = saved.differs(base)
    if why:
        raise CheckpointMismatchError(f"checkpoint {path} holds adapters of the base {saved.path}, and this "
                                      f"run's base {base.path} is not it: {why}")
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
    state = dist_checkpointing.load(_state(chunks, optimizer, is_loading=True), str(path))
    for i, chunk in enumerate(chunks):
        loaded = state[f"model{i}"]
        for local, name, param in named_adapters(unwrap(chunk)):
            if local not in loaded:
                raise CheckpointMismatchError(f"checkpoint {path} has no adapter {name}")
            param.copy_(loaded[local])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        unshare_adam_steps(optimizer)
