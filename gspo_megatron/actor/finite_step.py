"""The refusal of a non-finite update: a NaN or infinite loss or gradient is never applied to the
weights, so it never reaches SGLang either.

    reports = run_schedule(...)                # every micro-batch's forward and backward
    refuse_non_finite(chunks, reports)         # NonFiniteUpdate on every rank, before the step
    optimizer.step()

Where: after megatron-core's schedule has finished the gradients (finalize_model_grads: the DP
all-reduce or reduce-scatter of the grad buffers) and before `optimizer.step()`, which would clip
with a NaN norm (clip_grad_by_total_norm_fp32 then scales by nothing) and apply the NaN to every
weight. What is checked: the sum of the micro-batches' loss totals (last pipeline stage) and the
float64 sum of every local grad buffer of the model chunks (DistributedDataParallel.buffers and
expert_parallel_buffers, megatron-core 0.16 and 0.19), one NaN or inf anywhere making either
non-finite; the two flags are then all-reduced (MAX) over every rank, so a NaN on one pipeline
stage, expert or data-parallel rank stops all of them at the same point with the same message.

Cost per update: one read of the rank's local gradient buffer (a sum, no copy: at 3 TB/s, ~1 ms
per 3 GB of fp32 gradients) and one all-reduce of two numbers; the host waits for it once (the
step's metrics wait for the device anyway).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gspo_errors import GspoError
from gspo_megatron.parallel.comm import comm_device


class NonFiniteUpdate(GspoError):
    """The update's loss or gradient is NaN or infinite: refused before the optimizer step (exit 3)."""


def _grad_buffers(chunk: torch.nn.Module) -> list:
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


def local_totals(chunks: Sequence[torch.nn.Module], reports: Sequence[dict]) -> torch.Tensor:
    """[2] float64 on the communication device: this rank's loss total and gradient total (each
    non-finite when any of its terms is)."""
    device = comm_device()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for r in reports:
        if "loss_sum" in r:
            loss = loss + r["loss_sum"].detach().double().to(device)
    grad = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in chunks:
        for buffer in _grad_buffers(chunk):
            grad = grad + buffer.grad_data.sum(dtype=torch.float64).to(device)
    return torch.stack([loss, grad])


def refuse_non_finite(chunks: Sequence[torch.nn.Module], reports: Sequence[dict]) -> None:
    """NonFiniteUpdate on every rank when any rank's loss or gradient is not finite (collective
    over the default group; the module docstring says where and at what cost)."""
    bad = (~torch.isfinite(local_totals(chunks, reports))).to(torch.float64)  # [loss, gradient]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    loss_bad, grad_bad = (bool(x) for x in bad.cpu().tolist())
    if not (loss_bad or grad_bad):
        return
    what = " and ".join(w for w, b in (("loss", loss_bad), ("gradient", grad_bad)) if b)
    raise NonFiniteUpdate(
        f"the update's {what} is NaN or infinite: it was not applied to the weights and not sent to "
        "SGLang (the policy is the one before this mini-batch; resume from the last checkpoint once "
        "the cause is fixed). Causes seen: advantages that are NaN (a std over a single reward: "
        "loss.reward_norm_std), a learning rate that made the weights overflow (train.lr)")
