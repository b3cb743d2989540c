"""The actor's loss switch on real process groups (DP2): GSPO, GSPO-token and GRPO take the same
on-policy step (all three gradients are -A_i / (N L_i) per trained token at s = 1), CE reports the
token-mean NLL, the engine's log-probs can stand in for pi_old, temperature reaches the log-probs."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # 0.19.2: the same megatron-core paths run in test_actor_layouts' mcore019 layouts (suite time)


def _batch():
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(1)
    rows, seq = 7, 16
    lengths = torch.randint(5, seq + 1, (rows,), generator=g)
    t = torch.arange(seq)[None]
    mask = (t >= 2) & (t < lengths[:, None])
    return TrainBatch(tokens=torch.randint(0, 512, (rows, seq), generator=g), lengths=lengths,
                      loss_mask=mask, advantages=torch.randn(rows, generator=g),
                      rollout_log_probs=-6.0 + 0.5 * torch.randn(rows, seq, generator=g))


def _losses(rank, world):
    from gspo_megatron.actor import Actor, LogProbSettings, LossSettings, OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config

    actor = Actor(tiny_hf_config(), ParallelLayout(),
                  optimizer=OptimizerSettings(optimizer="sgd", lr=0.1, clip_grad=0.0), micro_batch_size=2)
    init = actor.full_state_dict()
    out = {}
    for name in ("gspo", "gspo_token", "grpo", "ce"):
        actor.load_full_state_dict(init)
        actor.loss = LossSettings(name=name)
        shard = actor.shard(_batch())
        shard.old_log_probs, old = actor.compute_old_log_probs(shard)
        metrics = actor.train_step(shard)
        state = actor.full_state_dict()
        out[name] = (old, metrics, {k: v.numpy() for k, v in state.items()} if rank == 0 else None)
    actor.load_full_state_dict(init)
    actor.loss = LossSettings(name="gspo")
    actor.old_log_probs = "engine"
    shard = actor.shard(_batch())
    shard.old_log_probs, engine_old = actor.compute_old_log_probs(shard)
    out["engine"] = (engine_old, actor.train_step(shard), None)
    actor.old_log_probs = "recompute"
    actor.logprob = LogProbSettings(temperature=2.0)
    out["hot"] = (actor.compute_old_log_probs(shard)[1], None, None)
    return out


def test_loss_switch_dp2():
    out = run_distributed(_losses, 2, timeout=300)[0]
    gspo_state = out["gspo"][2]
    for name in ("gspo_token", "grpo"):
        diff = max(float(abs(gspo_state[k] - v).max()) for k, v in out[name][2].items())
        assert diff < 1e-6, name
    assert max(float(abs(gspo_state[k] - v).max()) for k, v in out["ce"][2].items()) > 1e-3
    old, gspo, _ = out["gspo"]
    assert gspo["seq_ratio_min"] == pytest.approx(1.0, abs=1e-6)  # recomputed pi_old == pi_theta
    assert gspo["seq_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert gspo["clip_fraction"] == 0.0 and gspo["num_sequences"] == 7
    ce_old, ce, _ = out["ce"]
    assert ce["loss"] == pytest.approx(-ce_old["log_prob_mean"], rel=1e-5)
    assert ce["tokens"] == ce_old["tokens"]
    engine_old, engine, _ = out["engine"]
    assert engine_old == {}  # no forward pass: the rollout log-probs are pi_old
    assert engine["seq_ratio_max"] - engine["seq_ratio_min"] > 0.1
    assert engine["logprob_abs_diff_vs_rollout"] > 0.1
    assert out["hot"][0]["entropy_mean"] > old["entropy_mean"]  # T = 2 flattens the distribution
