"""Acceptance: routing replay (R3) and the routing drift metric in the actor, on real
gloo process groups.

The reference is megatron-core's own RouterReplay (REPLAY_FORWARD, moe/router_replay.py) on one
process, one micro-batch, each router given the batch's engine experts as [s * b, k] in the
router's s-major token order: "a forward pass forced to the same experts", by megatron's code, not
ours. Our replay (actor/router_control.py: per micro-batch, token by token, under TP/SP, EP and PP) must
give the same log-probs (1e-5), and after one GSPO step with replay the same parameters as one
process with our replay. The engine routing is random top-2 sets of 8 experts, so replayed and
natural routing differ on most tokens: a replay that dropped or misplaced indices would show.
The train steps also apply the mismatch corrections (TIS and token MIS), so those are checked
across layouts too.
"""
from __future__ import annotations

import pytest
import torch

from distributed import gather_row_values, run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.mcore019]

ROWS, SEQ, EXPERTS, TOPK, LAYERS = 6, 20, 8, 2, 4
TOL = 1e-5


def make_batch(with_routing: bool = True):
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(8, SEQ + 1, (ROWS,), generator=g)
    t = torch.arange(SEQ)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(0, 512, (ROWS, SEQ), generator=g), 0)
    mask = (t >= 3) & (t < lengths[:, None])
    routed = torch.rand(ROWS, SEQ, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK].to(torch.int16)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                      advantages=torch.randn(ROWS, generator=g),
                      # log pi_old is about -6.2 here: |d| ~ 0.5, so TIS and MIS below both act
                      rollout_log_probs=-6.2 + 0.5 * torch.randn(ROWS, SEQ, generator=g),
                      routed_experts=routed if with_routing else None)


def _megatron_replay(actor, batch):
    """Put megatron's RouterReplay on every router, forced to the batch's experts (one micro-batch)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    for model in actor.models:
        for module in model.modules():
            if isinstance(module, TopKRouter):
                replay = RouterReplay()
                layer = module.layer_number - 1
                replay.set_target_indices(batch.routed_experts[:, :, layer].long().transpose(0, 1)
                                          .reshape(-1, TOPK))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                module.router_replay = replay
    RouterReplay.clear_global_router_replay_instances()


def _run(rank, world, layout_kwargs, options, init_state):
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings, OptimizerSettings, RoutingSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe

    mode = options["mode"]  # "megatron" (reference), "replay", "natural"
    actor = Actor(qwen3_moe(num_experts=EXPERTS), ParallelLayout(**layout_kwargs),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0),
                  loss=LossSettings(name="grpo", tis_cap=1.5, mis_cap=2.0),
                  # the reference: one micro-batch of the rows in batch order (megatron's targets)
                  batching=MicroBatchSettings(micro_batch_size=options.get("micro_batch_size", 2),
                                              longest_first=mode != "megatron"),
                  routing=RoutingSettings(replay=mode == "replay", drift=True), seed=5 + rank)
    init = None
    if init_state is None:
        init = {k: v.numpy() for k, v in actor.full_state_dict().items()}
    else:
        actor.load_full_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    batch = make_batch()
    if options.get("packed_rows"):  # the trainer's form: real tokens only
        batch = batch.packed()
    shard = actor.shard(batch)
    if mode == "megatron":
        _megatron_replay(actor, shard)
        shard.routed_experts = None
    shard.old_log_probs, old_metrics = actor.compute_old_log_probs(shard)
    keeps = actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
    old = (shard.global_rows.numpy(), shard.padded().old_log_probs.numpy()) if keeps else None
    out = dict(old=old, old_metrics=old_metrics, init=init)
    if mode != "megatron":
        out["train"] = actor.train_step(shard)
        out["drift"] = actor.measure_routing_drift(shard)
        state = actor.full_state_dict(to_all_ranks=False)
        out["state"] = None if state is None else {k: v.numpy() for k, v in state.items()}
    return out


def _log_probs(results):
    batch = make_batch()
    valid = (torch.arange(SEQ)[None] >= 1) & (torch.arange(SEQ)[None] < batch.lengths[:, None])
    return gather_row_values([r["old"] for r in results], ROWS, SEQ), valid


@pytest.fixture(scope="module")
def megatron_forced():
    return run_distributed(_run, 1, ({}, {"mode": "megatron", "micro_batch_size": ROWS}, None),
                           timeout=240)[0]


@pytest.fixture(scope="module")
def one_process(megatron_forced):
    return run_distributed(_run, 1, ({}, {"mode": "replay"}, megatron_forced["init"]), timeout=240)[0]


def test_replay_equals_megatron_forced_forward(megatron_forced, one_process):
    want, valid = _log_probs([megatron_forced])
    got, _ = _log_probs([one_process])
    assert float((got - want)[valid].abs().max()) <= TOL
    natural = run_distributed(_run, 1, ({}, {"mode": "natural"}, megatron_forced["init"]), timeout=240)[0]
    free, _ = _log_probs([natural])
    assert float((free - want)[valid].abs().max()) > 1e-2, "replay made no difference: test too weak"
    m = one_process["old_metrics"]
    assert m["routing_replay_mismatch"] == 0.0 and m["routing_replay_mismatch_sets"] > 0
    assert m["routing_engine_mismatch"] > 0.5  # random engine sets vs the router's own choice
    # The router's own choice at layer 0 sees the same inputs with or without replay (later layers
    # see hidden states computed with the replayed experts).
    layer0 = "routing_engine_mismatch_layer/0"
    assert natural["old_metrics"][layer0] == pytest.approx(m[layer0])
    drift = one_process["drift"]
    assert 0.0 < drift["routing_drift"] < 1.0 and drift["routing_drift_sets"] == m["routing_engine_mismatch_sets"]
    assert set(k for k in drift if k.startswith("routing_drift_layer/")) == {
        f"routing_drift_layer/{i}" for i in range(LAYERS)}
    train = one_process["train"]  # the mismatch corrections acted (the layouts must agree on them)
    assert 0 < train["tis_truncated_fraction"] < 0.5 and 0 < train["mis_masked_fraction"] < 0.5
    assert train["mismatch_k3"] > 0


@pytest.mark.parametrize("layout", [dict(tensor=2), dict(expert=2), dict(pipeline=2)],
                         ids=["tp2", "ep2", "pp2"])
def test_replay_under_layouts(megatron_forced, one_process, layout):
    # The layouts run on packed rows (replay, the recorded drift table, the mismatch corrections'
    # row counts), the one-process reference on padded ones.
    results = run_distributed(_run, 2, (layout, {"mode": "replay", "packed_rows": True}, megatron_forced["init"]),
                              timeout=420)
    want, valid = _log_probs([megatron_forced])
    got, _ = _log_probs(results)
    assert float((got - want)[valid].abs().max()) <= TOL
    ref_state = one_process["state"]
    state = results[0]["state"]
    assert max(float(abs(torch.from_numpy(state[k]) - torch.from_numpy(ref_state[k])).max())
               for k in ref_state) <= TOL
    for key in ("routing_replay_mismatch", "routing_engine_mismatch", "routing_engine_mismatch_sets"):
        assert results[0]["old_metrics"][key] == pytest.approx(one_process["old_metrics"][key], abs=TOL)
    for key, value in one_process["drift"].items():
        assert results[0]["drift"][key] == pytest.approx(value, abs=TOL), key
    for key in ("loss", "tis_truncated_fraction", "mis_masked_fraction", "mismatch_k3", "mismatch_abs_mean"):
        assert results[0]["train"][key] == pytest.approx(one_process["train"][key], rel=TOL, abs=TOL), key
