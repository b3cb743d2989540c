"""What a closed Actor leaves in its process, and freeing it (Actor.close).

An Actor's own model, gradients, optimizer state, routing records and reference copies go with it
once the references that keep them alive are cut (cut_hidden_references) and the collector ran
(actor.py, Actor.close). What stays is the process's: state that megatron-core, Transformer
Engine and torch keep in module globals for whichever model runs next, allocated on first use and
kept for good. A trainer that shares its GPUs with SGLang (colocated) hands that memory to the
engine only if it is freed; on an H200 it was 96 MiB after every Actor of the local spec had
closed, 224 MiB with the TE spec (docs/results.md, the H200 visit).

What stays, who holds it, and when close() frees it:
- torch's cuBLAS workspaces: one per (cuBLAS handle, stream), a handle per thread, so the
  forward's and autograd's backward thread each have theirs; 32 MiB each on Hopper (torch 2.x
  CublasHandlePool.cpp, _getDefaultWorkspaceSize, unless CUBLAS_WORKSPACE_CONFIG says otherwise),
  allocated through the caching allocator, so memory_allocated() counts them. Every close
  (torch._C._cuda_clearCublasWorkspaces). No tensor holds them: the CPU cannot see them, the
  GPU check's memory row measures what each close freed (tools/gpu_check_memory.py).
- Transformer Engine's workspaces: `_cublas_workspace`, one per grouped-GEMM stream
  (`_multi_stream_cublas_workspace`, 4 streams) and `_dummy_wgrads`, 32 MiB + 256 B each on
  Hopper (transformer_engine/pytorch/module/base.py get_cublas_workspace_size_bytes, TE 2.x).
  Every close.
- megatron-core's global memory buffer: the scratch of sequence-parallel all-gathers and of the
  local attention's scores, the largest micro-batch's. Every close.
- megatron-core's aux-loss scales: MoEAuxLossAutoScaler's (and DSA's) `main_loss_backward_scale`,
  one element, set again at every step. Every close.
- the CPU twin of megatron's causal mask: our cache of masks (parallel/cpu_compat.py). Every close.
- megatron-core's RNG tracker: the model-, expert- and data-parallel RNG states, on the host. The
  last open Actor's close: a live Actor still forks from them.
Process groups stay: the trainer's teardown ends them (parallel/process_groups.py).
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from gspo_megatron.actor.build import unwrap

TE_BASE = "transformer_engine.pytorch.module.base"
"""Transformer Engine's module of workspaces (TE 2.x); never imported here, only read if loaded."""
_AUX_LOSS_SCALERS = (("megatron.core.transformer.moe.moe_utils", "MoEAuxLossAutoScaler"),
                     ("megatron.core.transformer.experimental_attention_variant.dsa",
                      "DSAIndexerLossAutoScaler"))
"""Classes whose `main_loss_backward_scale` is None until a step sets it (megatron-core 0.16 and
0.19 both create it again when it is None); MTPLossAutoScaler's defaults to a tensor, and stays."""


def cut_hidden_references(chunks: list[torch.nn.Module]) -> None:
    """What keeps a dropped Actor's model alive beyond Python's reach (Actor.close). A function of
    its own: its loop variables must be gone before close() collects."""
    for chunk in chunks:
        # A cycle the collector cannot see: megatron's MoE token dispatcher keeps the last
        # forward's routing probs (token_dispatcher.py, `self.probs`), whose autograd graph
        # reaches the router weight's AccumulateGrad node, whose DDP backward hook holds the
        # DDP chunk (C++ edges, not traversed by gc). Without this a trained MoE Actor
        # stayed in memory for good.
        for module in unwrap(chunk).modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            for name, value in list(vars(dispatcher).items()) if dispatcher is not None else ():
                if torch.is_tensor(value):
                    setattr(dispatcher, name, None)
        chunk.grad_accs.clear()  # type: ignore[union-attr,operator]  # megatron's DDP chunk: a list
        # megatron caches methods with functools.lru_cache on the class, `self` in the key
        # (RotaryEmbedding.forward in rotary_pos_embedding.py), which holds the module and,
        # through the cached values' graph, the rest. The caches only save recomputation.
        for cls in {c for m in unwrap(chunk).modules() for c in type(m).__mro__}:
            for attr in vars(cls).values():
                if callable(getattr(attr, "cache_clear", None)):
                    attr.cache_clear()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _megatron_buffer() -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps
    buffer: Any = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is None:
        return []
    dropped = [t for t in buffer.buffer.values() if torch.is_tensor(t)]
    buffer.buffer.clear()
    return dropped


def _aux_loss_scales() -> list[torch.Tensor]:
    dropped = []
    for module, name in _AUX_LOSS_SCALERS:
        cls: Any = getattr(sys.modules.get(module), name, None)
        scale = getattr(cls, "main_loss_backward_scale", None)
        if torch.is_tensor(scale):
            dropped.append(scale)
            cls.main_loss_backward_scale = None
    return dropped


def _cpu_causal_masks() -> list[torch.Tensor]:
    from gspo_megatron.parallel import cpu_compat
    return cpu_compat.clear_mask_cache()


def _te_workspaces() -> list[torch.Tensor]:
    base: Any = sys.modules.get(TE_BASE)
    if base is None:
        return []
    dropped: list[torch.Tensor] = []
    # Userbuffers (comm-GEMM overlap) keep their own view of the workspace: left alone when in use.
    if getattr(base, "_ub_communicators", None) is None and torch.is_tensor(getattr(base, "_cublas_workspace", None)):
        dropped.append(base._cublas_workspace)
        base._cublas_workspace = None
    streams = getattr(base, "_multi_stream_cublas_workspace", None)
    if streams:
        dropped += [t for t in streams if torch.is_tensor(t)]
        base._multi_stream_cublas_workspace = []  # get_multi_stream_cublas_workspace refills an empty list
    wgrads = getattr(base, "_dummy_wgrads", None)
    if wgrads:
        dropped += [t for t in wgrads.values() if torch.is_tensor(t)]
        base._dummy_wgrads = {}
    return dropped


def _rng_states() -> list[torch.Tensor]:
    from megatron.core.tensor_parallel import random as mrandom
    tracker: Any = getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is None:
        return []
    dropped = [s for s in getattr(tracker, "states_", {}).values() if torch.is_tensor(s)]
    tracker.reset()  # model_parallel_cuda_manual_seed adds them again for the next Actor
    return dropped


def _cublas_workspaces() -> int:
    """torch's cuBLAS workspaces, freed; the allocator's bytes they held (they are no tensors)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return 0
    torch.cuda.synchronize()  # a workspace in use by a kernel in flight must not be handed out
    before = torch.cuda.memory_allocated()
    clear()
    return before - torch.cuda.memory_allocated()


def release_process_caches(*, cuda: bool, transformer_engine: bool, last: bool) -> dict[str, int]:
    """Free what the table of the module docstring lists; `last`: no other Actor of this process
    is open (the RNG tracker goes too). `cuda` / `transformer_engine`: the machine's (an Actor's
    `Available`): the cuBLAS and TE workspaces are looked at only there. Returns the bytes each
    holder gave up (storage bytes of the tensors dropped; the allocator's for cuBLAS's)."""
    freed = {"megatron's global memory buffer": storage_bytes(_megatron_buffer()),
             "megatron's aux-loss scales": storage_bytes(_aux_loss_scales()),
             "CPU causal-mask cache": storage_bytes(_cpu_causal_masks())}
    if transformer_engine:
        freed["Transformer Engine's workspaces"] = storage_bytes(_te_workspaces())
    if last:
        freed["megatron's RNG tracker"] = storage_bytes(_rng_states())
    if cuda:
        freed["torch's cuBLAS workspaces"] = _cublas_workspaces()
    return freed
