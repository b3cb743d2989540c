"""Process-group set-up: torch.distributed (gloo on CPU, NCCL on GPU) + megatron parallel state.

    layout = ParallelLayout(tensor=2, pipeline=2, expert=2)
    init_process_groups(layout, seed=1234)   # after torchrun / srun set RANK, WORLD_SIZE, ...
    ...
    destroy_process_groups()
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from gspo_megatron.parallel import cpu_compat
from gspo_megatron.parallel.layout import ParallelLayout


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_groups(layout: ParallelLayout, *, seed: int = 1234, backend: str | None = None,
                        timeout_minutes: int = 10) -> None:
    """Join the default group (env:// rendezvous) if needed, then build megatron's groups.

    Apply layout.validate(...) with the model's dimensions before this: a layout that does not
    divide the world size must fail before the first collective.
    """
    backend = backend or default_backend()
    if backend == "gloo":
        cpu_compat.apply()
    elif torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A one-rank job needs no TCP rendezvous: an in-process store cannot lose its port to
            # another process between picking it and binding it (SGLang starts in that window).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    tp, pp, ep, etp, cp = layout.tensor, layout.pipeline, layout.expert, layout.etp, layout.context
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        # Re-checked here because a caller may skip validate(); megatron would assert deep inside.
        raise ValueError(f"world size {world} does not fit layout {layout}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    # Same seed on every rank for the data-parallel stream; megatron derives the TP / expert streams.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_process_groups() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
