"""A NaN loss or gradient is never applied (actor/finite_step.py): the train step refuses it on
every rank before the optimizer step, so the weights stay what they were and nothing NaN can be
synced to SGLang. Real gloo groups, DP2: the NaN is on one rank's rows only (or in one rank's
gradient buffer), and both ranks refuse with the same line."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # two ranks building the tiny MoE: about 20 s


def _batch(nan_row: int | None):
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(5)
    rows, seq = 8, 12
    lengths = torch.randint(6, seq + 1, (rows,), generator=g)
    t = torch.arange(seq)[None]
    adv = torch.randn(rows, generator=g)
    if nan_row is not None:
        adv[nan_row] = float("nan")  # what a std over a single reward gives (loss.reward_norm_std=batch)
    return TrainBatch(tokens=torch.randint(0, 512, (rows, seq), generator=g), lengths=lengths,
                      loss_mask=(t >= 3) & (t < lengths[:, None]), advantages=adv)


def _steps(rank, world):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.finite_step import NonFiniteUpdate, refuse_non_finite
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    out = {}
    with Actor(tiny_hf_config(), ParallelLayout(), optimizer=OptimizerSettings(optimizer="adam", lr=1e-2),
               loss=LossSettings(name="gspo"), micro_batch_size=2) as actor:
        before = actor.full_state_dict()
        shard = actor.shard(_batch(nan_row=3))
        out["nan_rows_here"] = int(torch.isnan(shard.advantages).sum())
        shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
        try:
            actor.train_step(shard)
            out["loss_nan"] = None
        except NonFiniteUpdate as e:
            out["loss_nan"] = str(e)
        out["moved_after_nan"] = max(float((v - before[k]).abs().max()) for k, v in actor.full_state_dict().items())
        # a finite step still trains (the check refuses nothing else)
        good = actor.shard(_batch(nan_row=None))
        good.old_log_probs, _ = actor.compute_old_log_probs(good)
        out["good_loss"] = actor.train_step(good)["loss"]
        out["moved_after_good"] = max(float((v - before[k]).abs().max()) for k, v in actor.full_state_dict().items())
        # a NaN in one rank's gradient buffer alone (the loss finite): both ranks refuse
        if rank == 1:
            actor.chunks[0].buffers[0].grad_data[0] = float("nan")
        try:
            refuse_non_finite(actor.chunks, [{"loss_sum": torch.tensor(1.0)}])
            out["grad_nan"] = None
        except NonFiniteUpdate as e:
            out["grad_nan"] = str(e)
    return out


def test_a_nan_on_one_rank_is_refused_on_every_rank_and_never_applied():
    ranks = run_distributed(_steps, 2, timeout=300)
    assert sorted(r["nan_rows_here"] for r in ranks) == [0, 1]  # the NaN row is on one rank only
    for r in ranks:
        assert r["loss_nan"] is not None and r["loss_nan"].startswith(
            "the update's loss and gradient is NaN or infinite: it was not applied to the weights and not sent to SGLang")
        assert r["moved_after_nan"] == 0.0              # refused before the optimizer step
        assert r["moved_after_good"] > 1e-4 and r["good_loss"] == r["good_loss"]
        assert r["grad_nan"] is not None and r["grad_nan"].startswith("the update's gradient is NaN or infinite")
    assert ranks[0]["loss_nan"] == ranks[1]["loss_nan"]
