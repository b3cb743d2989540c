"""Each loss aggregation (loss.loss_agg_mode) through the actor on real gloo ranks: DP2 with
token-budget micro-batches (different micro-batch counts per rank), PP2, and TP2 (MoE: sequence
parallel; the token counts must stay those of the DP group, not of every rank) give the one-process
parameters after each optimizer step (1e-5), as tests/actor/test_actor_layouts.py shows for the
default. The loss is grpo (the loss that takes every mode) with the dual clip; the optimizer is
linear in the gradient (Adam with eps = 10, see test_actor_layouts), so a wrong scale of the
token-mean's global token count, or of the token sums, moves the parameters by about the step
itself. The loss-level split over context-parallel ranks per mode: tests/algorithms/
test_advantage_layouts.py."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from test_actor_layouts import make_batch

pytestmark = pytest.mark.slow

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
TOL = 1e-5


def _run(rank, world, layout_kwargs, options, init_state):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import LogProbSettings, MicroBatchSettings, OptimizerSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe

    actor = Actor(qwen3_moe(), ParallelLayout(**layout_kwargs),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0),
                  loss=LossSettings(name="grpo"),
                  logprob=LogProbSettings(chunk_tokens=40),
                  batching=MicroBatchSettings(micro_batch_size=options.get("micro_batch_size", 64),
                                              max_tokens_per_micro_batch=options.get("max_tokens"),
                                              dp_balance="rows"),
                  seed=11 + rank)
    if init_state is None:
        init_state = {k: v.numpy() for k, v in actor.full_state_dict().items()}
    init = {k: torch.from_numpy(v) for k, v in init_state.items()}
    out = {"init": init_state if rank == 0 else None}
    for mode in MODES:
        actor.load_full_state_dict(init)
        actor.reset_optimizer()
        actor.loss = LossSettings(name="grpo", eps_low=0.02, eps_high=0.02, dual_clip_c=1.5, loss_agg_mode=mode,
                                  aggregation_args={"token_sum_norm": 2.0} if mode.endswith("norm") else {})
        shard = actor.shard(make_batch().packed(), num_mini_batches=2)
        shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
        metrics, states = [], []
        for mini in shard.mini_batches():
            metrics.append(actor.train_step(mini))
            state = actor.full_state_dict(to_all_ranks=False)  # collective: every rank takes part
            states.append({k: v.numpy() for k, v in state.items()} if rank == 0 else None)
        out[mode] = dict(metrics=metrics, states=states)
    return out


def _diff(a: dict, b: dict) -> float:
    return max(float(abs(torch.from_numpy(a[k]) - torch.from_numpy(b[k])).max()) for k in a)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_run, 1, ({}, {}, None), timeout=300)[0]


@pytest.mark.parametrize("world,layout,options", [
    (2, {}, dict(micro_batch_size=8, max_tokens=48)),           # DP2, token-budget micro-batches
    (2, dict(pipeline=2), dict(micro_batch_size=3)),             # PP2, uneven micro-batches
    (2, dict(tensor=2), dict(micro_batch_size=8, max_tokens=48)),  # TP2 (sequence parallel), token budget
], ids=["dp2_token_budget", "pp2", "tp2_token_budget"])
def test_every_aggregation_equals_one_process(reference, world, layout, options):
    results = run_distributed(_run, world, (layout, options, reference["init"]), timeout=600)
    moved = {}
    for mode in MODES:
        ref, got = reference[mode], results[0][mode]
        for step, (mine, want) in enumerate(zip(got["states"], ref["states"])):
            assert _diff(mine, want) <= TOL, (mode, step)
        for mine, want in zip(got["metrics"], ref["metrics"]):
            assert mine["loss"] == pytest.approx(want["loss"], rel=TOL, abs=TOL), mode
        moved[mode] = _diff(ref["states"][0], reference["init"])
        assert moved[mode] > 1e-2, mode  # a step large enough to show a wrong scale
    if world == 2 and not layout:
        assert max(m["num_microbatches"] for m in results[0]["seq-mean-token-mean"]["metrics"]) > 1
    # the modes are different objectives: their first steps differ
    assert len({round(moved[m], 6) for m in MODES}) == len(MODES)
