"""LoRA on every layout: the adapters' gradients under TP2 (sequence parallel), EP2, PP2 and DP2
equal one process's, for per-expert and shared-outer expert adapters, on real gloo groups; B at zero
is the base bit for bit; an adapter forward equals the dense model with merged weights; the base
never moves and the optimizer holds the adapters alone; and a deliberately wrong reduction group
fails the comparison.

One spawn of one rank makes the reference (both expert layouts), one spawn of two ranks runs every
layout in turn (megatron's groups are rebuilt per layout), so the module costs two spawns. Every
run starts from the reference's base and from adapters whose B is random (at zero, A would get no
gradient), trains two GSPO steps (two mini-batches) on the layout tests' batch, and returns the
adapters' gradients after the last step's reductions (DDP's main_grad) and their values after it;
and how many adapter parameters each rank held, against the planner's count. Adam with eps 10
makes the update ~ lr * g / eps, linear in the gradient (test_actor_layouts.py explains why).
"""
from __future__ import annotations

import contextlib
from typing import Literal

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow

TOL = 1e-5
EXPERTS = ("per_expert", "shared_outer")
# (name, layout, expert layout, planted bug): every layout with both expert layouts (shared-outer's
# reduction differs under EP: the shared A and B collect every EP rank's experts' tokens; and TP:
# each TP rank routed its own tokens), and per-expert adapters reduced over the dense group.
CASES = [(name, layout, experts, None) for name, layout in
         (("dp2", {}), ("tp2", dict(tensor=2, expert_tensor=1)), ("ep2", dict(expert=2)), ("pp2", dict(pipeline=2)))
         for experts in EXPERTS] + [("ep2", dict(expert=2), "per_expert", "expert_grads_over_dense_group")]


def _actor(layout: dict, experts: Literal["none", "per_expert", "shared_outer"], rank: int):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings, OptimizerSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe
    return Actor(qwen3_moe(), ParallelLayout(**layout),
                 optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0),
                 loss=LossSettings(name="gspo", eps_low=0.02, eps_high=0.002),
                 batching=MicroBatchSettings(micro_batch_size=4),
                 lora=LoraSettings(rank=4, alpha=8, experts=experts), seed=11)


@contextlib.contextmanager
def _planted(bug: str | None):
    """The bug Megatron-Bridge shipped (its issue 5229): routed experts' adapter gradients reduced
    over the dense data-parallel group, which under EP spans ranks holding other experts."""
    if bug is None:
        yield
        return
    from gspo_megatron.actor import build

    def attach_wrong(model, settings, *, seed):
        names = attach(model, settings, seed=seed)
        for name, param in model.named_parameters():
            if ".experts.lora." in name:
                param.allreduce = True
        return names
    attach = build.attach_lora
    build.attach_lora = attach_wrong
    try:
        yield
    finally:
        build.attach_lora = attach


def _np(state):
    return None if state is None else {k: v.numpy() for k, v in state.items()}


def _is_b(name: str) -> bool:
    return name.endswith((".b", "_b"))


def _fresh(actor, batch) -> dict:
    """Before anything is loaded into the adapters: their full values (A from the seed and the
    name, B zero) and whether the model's log-probs equal the base's bit for bit."""
    from gspo_megatron.lora.attach import adapters_off

    with_zero_b, _ = actor.compute_old_log_probs(batch)
    with adapters_off(actor.models):
        base, _ = actor.compute_old_log_probs(batch)
    return dict(fresh=_np(actor.full_adapter_state_dict(to_all_ranks=False)),
                zero_b_identical=None if base is None else bool(torch.equal(with_zero_b, base)))


def _step(actor, batch) -> dict:
    """One GSPO step from the loaded adapters: their gradients and values after it, and whether
    the base stayed bit for bit and the optimizer held the adapters alone."""
    from gspo_megatron.parallel.model_chunks import unwrap

    shard = actor.shard(batch, num_mini_batches=2)
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    frozen = [p for c in actor.models for p in c.parameters() if not p.requires_grad]
    before = [p.detach().clone() for p in frozen]
    adapters = {id(p) for c in actor.models for n, p in unwrap(c).named_parameters() if ".lora." in n}
    held = [p for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
            for g in sub.optimizer.param_groups for p in g["params"]]
    for mini in shard.mini_batches():
        actor.train_step(mini)
    return dict(base_unchanged=bool(frozen) and all(torch.equal(a, b) for a, b in zip(before, frozen)),
                optimizer_holds_adapters_only=len(held) == len(adapters) > 0
                and all(id(p) in adapters for p in held),
                grads=_np(actor.full_adapter_state_dict(grads=True, to_all_ranks=False)),
                values=_np(actor.full_adapter_state_dict(to_all_ranks=False)))


def _reference(rank, world):
    """One process: the shared start (the base, the adapters' A with a random B) and each expert
    layout's step; and the log-probs of the adapted model against the dense model holding the
    merged weights."""
    from gspo_megatron.lora.attach import adapters_off
    from gspo_megatron.lora.merge import merge_adapters
    from test_actor_layouts import make_batch

    out: dict = {}
    batch = make_batch()
    g = torch.Generator().manual_seed(7)
    for experts in EXPERTS:
        with _actor({}, experts, rank) as actor:
            out.setdefault("base", _np(actor.full_state_dict()))
            fresh = _fresh(actor, batch)
            start = {k: 0.05 * torch.randn(v.shape, generator=g) if _is_b(k) else torch.from_numpy(v)
                     for k, v in fresh["fresh"].items()}
            actor.load_full_adapter_state_dict(start)
            adapted, _ = actor.compute_old_log_probs(batch)
            actor.set_reference()  # the KL reference of a LoRA run: the base, adapters off
            reference, _ = actor.compute_ref_log_probs(batch)
            with adapters_off(actor.models):
                off, _ = actor.compute_old_log_probs(batch)
            base = {k: torch.from_numpy(v) for k, v in out["base"].items()}
            actor.load_full_state_dict(merge_adapters(base, start, actor.lora.scale, num_experts=4))
            with adapters_off(actor.models):
                dense, _ = actor.compute_old_log_probs(batch)
            actor.load_full_state_dict(base)
            out[experts] = dict(start=_np(start), adapted=adapted, dense=dense,
                                reference_is_base=bool(torch.equal(reference, off)) and not torch.equal(reference, adapted),
                                **fresh, **_step(actor, batch))
    return out


def _layouts(rank, world, cases, reference):
    from megatron.core import parallel_state as ps
    from test_actor_layouts import make_batch

    base = {k: torch.from_numpy(v) for k, v in reference["base"].items()}
    batch = make_batch()
    results = []
    for name, layout, experts, bug in cases:
        with _planted(bug), _actor(layout, experts, rank) as actor:
            actor.load_full_state_dict(base)
            fresh = _fresh(actor, batch)
            actor.load_full_adapter_state_dict(
                {k: torch.from_numpy(v) for k, v in reference[experts]["start"].items()})
            held = sum(p.numel() for c in actor.models for n, p in c.named_parameters() if ".lora." in n)
            results.append(dict(**fresh, **_step(actor, batch), held=held,
                                stage=ps.get_pipeline_model_parallel_rank()))
    return results


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1, timeout=240)[0]


@pytest.fixture(scope="module")
def layouts(reference):
    """{case index: [rank 0's results, rank 1's]} of every case, from one spawn of two ranks."""
    per_rank = run_distributed(_layouts, 2, (CASES, reference), timeout=600)
    return [[per_rank[r][i] for r in range(2)] for i in range(len(CASES))]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(abs(torch.from_numpy(a[k]) - torch.from_numpy(b[k])).max()) for k in a)


def test_merged_weights_equal_the_adapter_forward(reference):
    for experts in EXPERTS:
        r = reference[experts]
        assert r["zero_b_identical"], experts
        moved = float((r["adapted"] - r["dense"]).nan_to_num().abs().max())
        torch.testing.assert_close(r["adapted"], r["dense"], rtol=1e-6, atol=1e-6, equal_nan=True)
        assert r["base_unchanged"] and r["optimizer_holds_adapters_only"], experts
        assert r["reference_is_base"], experts
        assert moved < 1e-5


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[3] is None],
                         ids=[f"{c[0]}-{c[2]}" for c in CASES if c[3] is None])
def test_adapter_gradients_equal_one_process(reference, layouts, case):
    experts = CASES[case][2]
    ref, ranks = reference[experts], layouts[case]
    mine = ranks[0]
    assert _max_diff(mine["fresh"], ref["fresh"]) == 0.0, "every layout starts from the same adapters"
    assert any(r["zero_b_identical"] for r in ranks) and all(r["zero_b_identical"] in (None, True) for r in ranks)
    assert all(r["base_unchanged"] and r["optimizer_holds_adapters_only"] for r in ranks)
    assert min(float(abs(v).max()) for v in ref["grads"].values()) > 1e-4, "a tensor got no gradient"
    assert _max_diff(mine["grads"], ref["grads"]) <= TOL
    assert _max_diff(mine["values"], ref["values"]) <= TOL


def test_the_planner_counts_each_ranks_adapters(layouts):
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import stage_adapter_params
    from model_specs.hf.tiny import qwen3_moe
    from model_specs.shape import model_shape_for
    shape = model_shape_for(qwen3_moe())
    for (name, layout, experts, _), ranks in zip(CASES, layouts):
        lora = LoraSettings(rank=4, alpha=8, experts=experts)
        for r in ranks:
            assert sum(stage_adapter_params(shape, ParallelLayout(**layout), r["stage"], lora)) == r["held"], name


def test_a_wrong_reduction_group_is_caught(reference, layouts):
    case = next(i for i, c in enumerate(CASES) if c[3] is not None)
    wrong = layouts[case][0]
    assert _max_diff(wrong["grads"], reference[CASES[case][2]]["grads"]) > 100 * TOL
