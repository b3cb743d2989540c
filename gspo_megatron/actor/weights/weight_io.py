"""The Actor's weights as the rest of the library sees them: one-process state dicts of the model
and of its LoRA adapters, training checkpoints, the base a LoRA run starts from. A mixin of Actor
(actor.py), which supplies `chunks`, `models`, `optimizer`, `scheduler` and `lora`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gspo_megatron.actor.weights.adapter_state import full_adapter_state_dict, load_full_adapter_state_dict
from gspo_megatron.actor.weights.full import full_state_dict, load_full_state_dict
from gspo_megatron.checkpoint.lora_checkpoint import (base_reference, load_adapters_and_optimizer,
                                               save_adapters_and_optimizer)
from gspo_megatron.checkpoint.model_io import load_model, load_model_and_optimizer, save_model_and_optimizer

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


class WeightIO:
    """The Actor's weights and checkpoints (module docstring)."""

    base: Path | None = None
    """The checkpoint load_weights read: a LoRA run's base, which its checkpoints name."""

    if TYPE_CHECKING:  # the Actor's (actor.py)
        from gspo_megatron.lora.lora_settings import LoraSettings
        optimizer: Any
        scheduler: Any
        lora: LoraSettings

    @property
    def chunks(self) -> list[DistributedDataParallel]:
        raise NotImplementedError

    @property
    def models(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def full_state_dict(self, *, to_all_ranks: bool = True) -> dict[str, torch.Tensor] | None:
        """All parameters as one-process (TP1/PP1/EP1) megatron tensors; see weights.py."""
        return full_state_dict(self.chunks, to_all_ranks=to_all_ranks)

    def full_adapter_state_dict(self, *, grads: bool = False,
                                to_all_ranks: bool = True) -> dict[str, torch.Tensor] | None:
        """The LoRA adapters as one-process tensors (their gradients with `grads`); adapter_state.py."""
        return full_adapter_state_dict(self.chunks, grads=grads, to_all_ranks=to_all_ranks)

    def load_full_adapter_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load one-process adapter tensors into this layout (every rank passes the dict)."""
        load_full_adapter_state_dict(self.chunks, full)
        self.optimizer.reload_model_params()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load one-process megatron tensors into this layout (every rank passes the dict)."""
        load_full_state_dict(self.chunks, full)
        self.optimizer.reload_model_params()  # refresh fp32 main copies of bf16/fp16 params

    def save(self, path: str | Path) -> dict[str, Any]:
        """Collective: write this rank's model and optimizer shards into `path` (megatron
        dist_checkpointing; loads under any layout). Returns the LR scheduler's state (small,
        the same on every rank) for the caller to keep with its loop state. With LoRA: the
        adapters and their optimizer state, and the base by reference (checkpoint/lora_checkpoint.py)."""
        if self.lora.enabled:
            save_adapters_and_optimizer(Path(path), self.chunks, self.optimizer, base_reference(self.base))
        else:
            save_model_and_optimizer(Path(path), self.chunks, self.optimizer)
        return self.scheduler.state_dict()

    def load(self, path: str | Path, scheduler_state: dict[str, Any] | None = None) -> None:
        """Collective: load model and optimizer shards written by `save` under any layout, and the
        scheduler state `save` returned. With LoRA the base is loaded first (load_weights) and
        must be the one the checkpoint names."""
        if self.lora.enabled:
            load_adapters_and_optimizer(Path(path), self.chunks, self.optimizer, base_reference(self.base))
        else:
            load_model_and_optimizer(Path(path), self.chunks, self.optimizer)
        if scheduler_state:
            self.scheduler.load_state_dict(scheduler_state)

    def load_weights(self, path: str | Path) -> None:
        """Collective: load the model weights of a model-only checkpoint (converter output); with
        LoRA the base, which the run's checkpoints then name (`base`)."""
        load_model(self.models, path)
        self.base = Path(path)
        self.optimizer.reload_model_params()
