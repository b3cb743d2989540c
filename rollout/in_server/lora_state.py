"""A served LoRA adapter written in place, inside the SGLang server (called by weight_loader.load
for a payload with a `|lora=NAME` entry).

SGLang 0.5.23 can load an adapter (/load_lora_adapter, /load_lora_adapter_from_tensors) and unload
one, but not change one: a new version under the same name would need an unload, which waits for
every request still using the adapter (sglang/srt/lora/lora_manager.py unload_lora_adapter; miles
deadlocked there with generation paused). So the trainer creates the run's adapter once
and then writes each version into the server's own state, between two forward batches (the
scheduler runs a weight update between batches):
1. the new PEFT tensors are normalized exactly as SGLang loads an adapter (a LoRAAdapter of the
   held adapter's config: q/k/v and gate/up stacked, sglang/srt/lora/lora.py _normalize_weights);
2. they are copied into the held adapter's host tensors, whose shapes must not change (a new
   rank or new targets need a new adapter);
3. if the adapter sits in a slot of the memory pool (the device buffers the forward reads), the
   slot is loaded again with SGLang's own LoRAMemoryPool.load_lora_weight_to_buffer (its TP
   slicing and its scaling of the experts' B), and the LoRA layers are told
   (LoRAManager._notify_lora_slots_updated).
Requests in flight keep running: their next forward reads the new version.
"""
from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any, Mapping

import torch

_MANAGER: list[Any] = []  # a weak reference to this process's LoRAManager, once found


def lora_manager() -> Any:
    """This server process's LoRAManager, held by the model runner; LookupError when the server
    runs without --enable-lora. Called from within a weight update: SGLang calls a custom loader
    from its WeightUpdater, which reaches the model runner (sglang 0.5.23
    model_runner_components/weight_updater.py, `get_model_runner`), so the caller's frames lead to
    it. (The objects themselves cannot be searched for: SGLang freezes the garbage collector at
    start, /freeze_gc, and gc.get_objects() then lists none of them.)"""
    if _MANAGER and _MANAGER[0]() is not None:
        return _MANAGER[0]()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        getter = getattr(frame.f_locals.get("self"), "get_model_runner", None)
        if callable(getter):
            manager = getattr(getter(), "lora_manager", None)
            if manager is None:
                raise LookupError("this server holds no LoRA manager: was it started with --enable-lora?")
            _MANAGER[:] = [weakref.ref(manager)]
            return manager
        frame = frame.f_back
    raise LookupError("no SGLang weight update calls this loader (no WeightUpdater among the callers): "
                      "the LoRA state is reached only from within one")


def _uid(manager: Any, name: str) -> str:
    for ref in manager.lora_refs.values():
        if ref.lora_name == name:
            return ref.lora_id
    held = sorted(r.lora_name for r in manager.lora_refs.values())
    raise LookupError(f"no LoRA adapter named {name!r} on this server (it holds {held}): load it "
                      "first (/load_lora_adapter_from_tensors)")


@torch.no_grad()
def write_adapter(name: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Write PEFT tensors (SGLang's names) into the held adapter `name` (module docstring); returns
    the normalized tensors that differ from what was sent after the write (none when it landed)."""
    from sglang.srt.lora.lora import LoRAAdapter
    manager = lora_manager()
    uid = _uid(manager, name)
    held = manager.loras[uid]
    fresh = LoRAAdapter(uid, manager.configs[uid], manager.base_hf_config, manager.load_config,
                        manager.lora_backend, base_model=manager.base_model)
    fresh.initialize_weights_from_tensors({k: v.cpu() for k, v in tensors.items()})
    pairs = []
    for i, (old, new) in enumerate(zip(held.layers, fresh.layers)):
        if set(old.weights) != set(new.weights):
            raise ValueError(f"adapter {name!r} layer {i}: the update adapts {sorted(new.weights)}, the "
                             f"served adapter {sorted(old.weights)}: load a new adapter for new targets")
        for key, value in new.weights.items():
            if old.weights[key].shape != value.shape:
                raise ValueError(f"adapter {name!r}: {key} has shape {tuple(value.shape)}, the served "
                                 f"one {tuple(old.weights[key].shape)} (another rank?)")
            pairs.append((key, old.weights[key], value))
    if set(held.embedding_layers) != set(fresh.embedding_layers):
        raise ValueError(f"adapter {name!r}: embedding adapters {sorted(fresh.embedding_layers)} differ "
                         f"from the served {sorted(held.embedding_layers)}")
    pairs += [(k, held.embedding_layers[k], v) for k, v in fresh.embedding_layers.items()]
    for _, old, new in pairs:
        old.copy_(new)
    for layer in held.layers:
        layer.pinned_weights.clear()  # scaled host copies of the old values (mem_pool.py's cache)
    held.pinned_embedding_layers.clear()
    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id.get(uid)
    if slot is not None:
        pool.load_lora_weight_to_buffer(uid, slot, held, manager.lora_modules,
                                        manager.embed_tokens_module, manager.lm_head_module)
        manager._notify_lora_slots_updated({slot})
    return [key for key, old, new in pairs if not torch.equal(old, new)]
