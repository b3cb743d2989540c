"""The KL in the reward (loss.kl_in_reward_coef): the advantages of a rank's rows, finished on the
last pipeline stage once pi_old's and the reference's log-probs are there.

    shard.advantages = reward_kl_advantages(shard, cfg.loss, group_size)

The driver leaves the advantages at 0 and sends each row's shaped reward (TrainBatch.rewards);
here every trained token's reward gets -beta * KL_t(pi_old || pi_ref) and the estimator runs
(algorithms/advantage/pipeline.py) with its group sums and whitening statistics all-reduced over
the data-parallel group: each DP rank holds other rows of the same groups, and all of them use one
baseline per group and one mean and variance for the batch, as one process would on the whole
batch. Under context parallelism every CP rank holds the whole rows' log-probs (steps.compute_log_probs
gathers them), so the DP group without CP is the right one; other pipeline stages keep the batch's
advantages (they never read them).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.actor.forward import is_last_stage_rank
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.algorithms.kl import token_kl
from gspo_megatron.parallel.comm import comm_device


def _all_reduce(group):
    """The pipeline's all-reduce over `group`, on the group's device (pure torch stays on the host)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.to(comm_device(group))
        dist.all_reduce(out, op=ops[op], group=group)
        return out.cpu()
    return reduce


def reward_kl_advantages(shard: TrainBatch, settings: AdvantageSettings, group_size: int) -> torch.Tensor:
    """This rank's advantages in the shard's form ([b] per row, [T] packed or [b, s] padded per
    token); collective over the last stage's data-parallel group."""
    if not is_last_stage_rank():
        return shard.advantages
    if shard.rewards is None or shard.global_rows is None or shard.ref_log_probs is None \
            or shard.old_log_probs is None:
        raise ValueError("the KL in the reward needs the shard's rewards, global_rows and pi_old's and "
                         "the reference's log-probs on the last pipeline stage")
    packed = shard.packed()
    old, ref, rewards = packed.old_log_probs, packed.ref_log_probs, packed.rewards
    if old is None or ref is None or rewards is None:  # packed() keeps every field it was given
        raise ValueError("the packed shard lost its log-probs or rewards")
    group = ps.get_data_parallel_group()
    groups = shard.global_rows // group_size
    num = torch.tensor([int(groups.max()) + 1 if groups.numel() else 0], dtype=torch.long,
                       device=comm_device(group))
    dist.all_reduce(num, op=dist.ReduceOp.MAX, group=group)
    rows = BatchRows(packed.lengths, packed.loss_mask, groups, int(num.item()))
    kl = token_kl(old.double(), ref.double(), settings.kl_in_reward_estimator)
    adv, _ = batch_advantages(settings, rewards, rows, kl=kl,
                              all_reduce=_all_reduce(group) if dist.get_world_size(group) > 1 else None)
    adv = adv.float()
    if adv.numel() == shard.num_rows or shard.is_packed:
        return adv
    out = torch.zeros(shard.padded_shape, dtype=adv.dtype)  # per token, back to the padded form
    out[torch.arange(out.shape[1])[None, :] < shard.lengths[:, None]] = adv
    return out
