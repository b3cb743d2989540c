"""The KL penalty in the actor: reference log-probs from swapped-in reference weights, on real
process groups (one process and PP2, where the log-probs live on the last stage only).

- The reference pass gives exactly the log-probs the reference weights gave before the update, and
  leaves the trained weights bit-for-bit as they were (the swap is an exchange, done twice).
- A reference loaded from a saved one-process state dict (what a resumed run does) is the same.
- With zero advantages only the KL term moves the weights; the reported KL is the k3 estimate
  recomputed from the two sets of log-probs; and PP2 takes the same step as one process.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # 0.19.2: the same megatron-core paths run in test_actor_layouts' mcore019 layouts (suite time)


def _batch(advantages: float | None = None):
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(3)
    rows, seq = 6, 14
    lengths = torch.randint(6, seq + 1, (rows,), generator=g)
    t = torch.arange(seq)[None]
    mask = (t >= 3) & (t < lengths[:, None])
    adv = torch.randn(rows, generator=g) if advantages is None else torch.full((rows,), advantages)
    return TrainBatch(tokens=torch.randint(0, 512, (rows, seq), generator=g), lengths=lengths,
                      loss_mask=mask, advantages=adv)


def _kl_steps(rank, world, pipeline, start=None):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config

    actor = Actor(tiny_hf_config(), ParallelLayout(pipeline=pipeline),
                  optimizer=OptimizerSettings(optimizer="sgd", lr=0.5, clip_grad=0.0),
                  micro_batch_size=2, loss=LossSettings(name="gspo"))
    if start is not None:  # the one-process run's initial weights: both layouts start equal
        actor.load_full_state_dict(start)
    init = actor.full_state_dict()
    actor.set_reference()
    # lp0: the reference weights' log-probs; then one GSPO step moves the weights away.
    shard = actor.shard(_batch())
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    lp0 = shard.old_log_probs
    actor.train_step(shard)
    trained = actor.full_state_dict()

    probe = actor.shard(_batch())
    probe.ref_log_probs, _ = actor.compute_ref_log_probs(probe)
    after_swap = actor.full_state_dict()
    swap_exact = max(float((trained[k] - v).abs().max()) for k, v in after_swap.items())
    ref_err = None if lp0 is None else float((probe.ref_log_probs - lp0).abs()[probe.loss_mask].max())
    changed = max(float((trained[k] - init[k]).abs().max()) for k in init)

    # The same reference, loaded from the saved one-process tensors.
    actor.set_reference(init)
    probe2 = actor.shard(_batch())
    probe2.ref_log_probs, _ = actor.compute_ref_log_probs(probe2)
    ref2_err = None if lp0 is None else float((probe2.ref_log_probs - lp0).abs()[probe2.loss_mask].max())
    assert max(float((after_swap[k] - v).abs().max()) for k, v in actor.full_state_dict().items()) == 0.0

    # Zero advantages: without KL nothing moves; with KL (k3) the step pulls towards the reference.
    zero = actor.shard(_batch(advantages=0.0))
    zero.old_log_probs, _ = actor.compute_old_log_probs(zero)
    lp1 = zero.old_log_probs
    zero.ref_log_probs, _ = actor.compute_ref_log_probs(zero)
    actor.train_step(zero)
    no_kl_move = max(float((actor.full_state_dict()[k] - v).abs().max()) for k, v in trained.items())
    actor.loss = LossSettings(name="gspo", kl_coef=1.0, kl_estimator="k3")
    metrics = actor.train_step(zero)
    final = actor.full_state_dict()
    expected_kl = None
    if lp1 is not None:
        mask = zero.loss_mask
        d = torch.where(mask, zero.ref_log_probs - lp1, 0.0).double()
        k3 = torch.where(mask, torch.exp(d) - d - 1, 0.0).sum(1) / mask.sum(1)
        expected_kl = float(k3[mask.any(1)].mean())
    return dict(swap_exact=swap_exact, ref_err=ref_err, ref2_err=ref2_err, changed=changed,
                no_kl_move=no_kl_move, kl=metrics["kl"], expected_kl=expected_kl,
                final={k: v.clone() for k, v in final.items()} if rank == 0 else None,
                trained={k: v.clone() for k, v in trained.items()} if rank == 0 else None,
                init={k: v.clone() for k, v in init.items()} if rank == 0 else None)


def test_reference_log_probs_and_kl_step_one_process_and_pp2():
    one = run_distributed(_kl_steps, 1, args=(1,), timeout=300)[0]
    pp2 = run_distributed(_kl_steps, 2, args=(2, one["init"]), timeout=300)
    last = pp2[1]  # the last pipeline stage holds the log-probs
    for r in (one, last):
        assert r["changed"] > 1e-3               # the GSPO step moved the weights
        assert r["swap_exact"] == 0.0            # the reference pass left them bit-exact
        assert r["ref_err"] == 0.0 and r["ref2_err"] == 0.0
        assert r["no_kl_move"] == 0.0            # zero advantages, no KL: SGD does not move
        assert r["expected_kl"] > 1e-6
        assert abs(r["kl"] - r["expected_kl"]) < 1e-6, (r["kl"], r["expected_kl"])
    assert pp2[0]["kl"] == last["kl"]            # metrics reach every rank
    kl_move = max(float((one["final"][k] - one["trained"][k]).abs().max()) for k in one["final"])
    assert kl_move > 1e-5                         # the KL term alone moved the weights
    err = max(float((one["final"][k] - v).abs().max()) for k, v in pp2[0]["final"].items())
    assert err < 1e-5, err
