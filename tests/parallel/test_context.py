"""Context parallelism (parallel.context) on CPU: the zig-zag split (against megatron's own), the
actor's micro-batch chunks (targets shifted before splitting), the GSPO / GSPO-token / GRPO losses
with their KL term and mismatch corrections reduced over a real 2-rank gloo CP group against one
process on the whole rows, and the errors where CP cannot run. The model side of CP (Transformer
Engine's attention, CUDA only) is tools/gpu_check.py's CP row."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from distributed import run_distributed
from gspo_megatron.parallel import context
from gspo_megatron.parallel.layout import LayoutError, ParallelLayout

CP_ERROR = ("parallel.context=2 needs the Transformer Engine layer spec on CUDA: megatron's local "
            "attention does not support context parallelism")


# --- (a) the split ------------------------------------------------------------------------------
def test_zigzag_split_and_join_round_trip():
    assert context.positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context.positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert context.positions(12, 1, 3).tolist() == [2, 3, 8, 9]
    t = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for size in (1, 2, 3, 4):
        parts = [context.split(t, r, size) for r in range(size)]
        assert all(p.shape == (2, 24 // size, 3) for p in parts)
        assert torch.equal(context.join(parts), t)
        held = torch.cat([context.positions(24, r, size) for r in range(size)])
        assert sorted(held.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2 x context = 4"):
        context.split(torch.zeros(1, 6), 0, 2)


def _train_batch(b: int = 3, s: int = 8):
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([s, s - 2, 3])[:b]
    t = torch.arange(s)[None]
    return TrainBatch(tokens=torch.randint(1, 50, (b, s), generator=g), lengths=lengths,
                      loss_mask=(t >= 1) & (t < lengths[:, None]) & (t != 4),
                      advantages=torch.randn(b, s, generator=g),
                      old_log_probs=-torch.rand(b, s, generator=g),
                      rollout_log_probs=-torch.rand(b, s, generator=g))


def test_micro_batch_chunks_take_targets_before_splitting():
    from gspo_megatron.actor.batching.micro_batch import context_chunks, from_input_positions, micro_batch
    mb = micro_batch(_train_batch(), 0, [0, 1, 2], seq_multiple=4)
    s = mb.tokens.shape[1]
    parts = [context_chunks(mb, r, 2) for r in range(2)]
    for r, part in enumerate(parts):
        pos = context.positions(s, r, 2)
        assert torch.equal(part.tokens, mb.tokens[:, pos]) and torch.equal(part.position_ids, mb.position_ids[:, pos])
        nxt = pos + 1  # input position p predicts the token at p + 1, which may be another rank's
        inside = nxt < s
        assert torch.equal(part.targets[:, inside], mb.tokens[:, nxt[inside]])
        assert torch.equal(part.loss_mask[:, inside], mb.loss_mask[:, nxt[inside]])
        assert not part.loss_mask[:, ~inside].any()
        assert torch.equal(part.rows, mb.rows) and torch.equal(part.lengths, mb.lengths)
    for name in ("loss_mask", "advantages", "old_log_probs", "rollout_log_probs"):
        joined = from_input_positions(context.join([getattr(p, name) for p in parts]))
        # column 0 (nothing predicts the first token; never trained) drops out
        assert torch.equal(joined[:, 1:], getattr(mb, name)[:, 1:]) and not joined[:, 0].any(), name
    # What the last stage computes per input position p (here a stand-in for log p(targets[p] | <= p))
    # comes back, joined over the ranks, as the target-aligned log-probs of one process.
    def fake_lp(positions, targets):
        return -0.01 * (positions + 1) * targets
    full = torch.cat([torch.zeros(3, 1), fake_lp(mb.position_ids[:, :-1], mb.tokens[:, 1:])], dim=1)
    local = [fake_lp(p.position_ids, p.targets) for p in parts]
    assert torch.allclose(from_input_positions(context.join(local)), full)


# --- (b) the loss reduction on 2 gloo ranks -------------------------------------------------------
CORRECTIONS: dict[str, dict[str, Any]] = {"seq": dict(tis_cap=1.5, seq_is_cap=1.1, mis_cap=1.15, mis_level="sequence"),
               "tok": dict(tis_cap=1.5, mis_cap=2.0, mis_level="token")}
CASES: dict[str, tuple[str, str, dict[str, Any], str | None]] = {  # name: (loss, advantages, kwargs, corrections)
    "gspo": ("gspo", "row", dict(eps_low=0.05, eps_high=0.05), None),
    "gspo_mean": ("gspo", "row", dict(eps_low=0.05, eps_high=0.05, reduction="mean"), None),
    "gspo_token": ("gspo_token", "token", dict(eps_low=0.05, eps_high=0.05), None),
    "grpo": ("grpo", "row", {}, None),
    "grpo_token_adv": ("grpo", "token", {}, None),
    "gspo_kl_k3": ("gspo", "row", dict(eps_low=0.05, eps_high=0.05, kl_coef=0.1), None),
    "gspo_token_kl_k1": ("gspo_token", "token", dict(eps_low=0.05, eps_high=0.05, kl_coef=0.1,
                                                     kl_estimator="k1"), None),
    "grpo_kl_k3": ("grpo", "row", dict(kl_coef=0.1), None),
    "gspo_mismatch_seq": ("gspo", "row", dict(eps_low=0.05, eps_high=0.05), "seq"),
    "gspo_token_mismatch_tok": ("gspo_token", "token", dict(eps_low=0.05, eps_high=0.05), "tok"),
    "grpo_mismatch_seq": ("grpo", "row", dict(kl_coef=0.1), "seq"),
    # ROLL's importance_sampling: seq: the sequence ratio on each token, the tokens' terms aggregated
    "gspo_token_sums_mismatch_tok": ("gspo", "row", dict(eps_low=0.05, eps_high=0.05, kl_coef=0.1,
                                                         loss_agg_mode="seq-mean-token-sum"), "tok"),
    "gspo_token_adv_token_mean": ("gspo", "token", dict(eps_low=0.05, eps_high=0.05, loss_agg_mode="token-mean"), None),
    "gspo_token_token_sum": ("gspo_token", "token", dict(eps_low=0.05, eps_high=0.05,
                                                         loss_agg_mode="seq-mean-token-sum"), None),
}


def _data(b: int = 6, s: int = 16) -> dict[str, torch.Tensor]:
    """The same rows on every rank: masks with holes, a row without trained tokens (4), a row
    trained only inside CP rank 0's first chunk (5), NaN at untrained positions of the log-probs,
    rows clearly clipped and clearly not (per-row offsets of the log-ratio)."""
    g = torch.Generator().manual_seed(0)
    lp = -3 * torch.rand(b, s, generator=g)
    offset = torch.tensor([0.2, -0.2, 0.01, -0.01, 0.0, -0.01])[:, None]
    old = lp - offset + 0.02 * torch.randn(b, s, generator=g)
    mask = torch.rand(b, s, generator=g) < 0.7
    mask[:, 0] = False
    mask[4] = False
    mask[5] = False
    mask[5, 2:4] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 2.0])
    return dict(lp=torch.where(mask, lp, float("nan")), old=old, mask=mask, adv_row=adv,
                adv_token=adv[:, None] + 0.5 * torch.randn(b, s, generator=g),
                ref=lp + 0.1 * torch.randn(b, s, generator=g),
                rollout=old + 0.3 * torch.randn(b, s, generator=g))


def _run_case(case: str, d: dict, cut, cp_group):
    from gspo_megatron.algorithms import LOSS_FUNCTIONS
    from gspo_megatron.algorithms.mismatch import mismatch_correction
    name, adv_kind, kwargs, corr = CASES[case]
    kwargs = dict(kwargs)
    reduction = kwargs.pop("reduction", "sum")
    lp = cut(d["lp"]).detach().clone().requires_grad_()
    old, mask = cut(d["old"]), cut(d["mask"])
    adv = cut(d["adv_token"]) if adv_kind == "token" else d["adv_row"]
    totals = {}
    if corr is not None:
        c = mismatch_correction(old, cut(d["rollout"]), mask, **CORRECTIONS[corr], cp_group=cp_group)
        mask, totals = c.loss_mask, c.totals
        kwargs.update(token_weights=c.token_weights, row_weights=c.row_weights)
    if kwargs.get("kl_coef"):
        kwargs["ref_log_probs"] = cut(d["ref"])
    loss, metrics = LOSS_FUNCTIONS[name](lp, old, adv, mask, reduction=reduction, cp_group=cp_group, **kwargs)
    grad, = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics, totals


def _group_metrics(metrics: dict, group) -> dict:
    """The metrics of the CP ranks combined as the actor does: each key by its reduction."""
    import torch.distributed as dist
    from gspo_megatron.algorithms import METRIC_REDUCTIONS, finalize_metrics
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    out = {}
    for key, op in METRIC_REDUCTIONS.items():
        if key in metrics:
            t = metrics[key].detach().clone().double()
            dist.all_reduce(t, op=ops[op], group=group)
            out[key] = t
    return finalize_metrics(out)


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max((abs(float(a[k]) - float(b[k])) if math.isfinite(float(a[k])) else
                float(float(a[k]) != float(b[k]))) for k in a) if a else 0.0


def _megatron_split(batch: dict, group) -> dict:
    import inspect

    from megatron.core import utils
    f = utils.get_batch_on_this_cp_rank  # 0.19 adds is_hybrid_cp before cp_group
    if "is_hybrid_cp" in inspect.signature(f).parameters:
        return f(dict(batch), is_hybrid_cp=False, cp_group=group)
    return f(dict(batch), cp_group=group)


def _cp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.forward import seq_multiple
    from gspo_megatron.algorithms.mismatch import mismatch_correction
    from gspo_megatron.parallel.process_groups import init_process_groups
    init_process_groups(ParallelLayout(context=2))  # megatron's CP group, on gloo
    group = ps.get_context_parallel_group()
    out: dict[str, Any] = {"sizes": (ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size(),
                     ps.get_data_parallel_world_size(with_context_parallel=True), seq_multiple())}
    batch = {"tokens": torch.arange(2 * 16).view(2, 16), "loss_mask": torch.rand(2, 16) < 0.5,
             "hidden": torch.randn(2, 16, 3)}
    theirs = _megatron_split(batch, group)
    out["megatron_split"] = all(torch.equal(theirs[k], context.split(v, rank, 2)) for k, v in batch.items())
    out["all_gather"] = torch.equal(context.all_gather(context.split(batch["hidden"], rank, 2), group),
                                    batch["hidden"])
    d = _data()
    out["masked_rows"] = int(mismatch_correction(d["old"], d["rollout"], d["mask"], **CORRECTIONS["seq"])
                             .totals["mis_masked_sequences"])

    def cut(t):
        return context.split(t, rank, 2)

    for case in CASES:
        ref_loss, ref_grad, ref_metrics, ref_totals = _run_case(case, d, lambda t: t, None)
        loss, grad, metrics, totals = _run_case(case, d, cut, group)
        full_grad = context.all_gather(grad, group)
        summed = {k: v.detach().clone().double() for k, v in totals.items()}
        for v in summed.values():
            dist.all_reduce(v, group=group)
        plain_loss, plain_grad, _, _ = _run_case(case, d, cut, None)  # no reduction over CP
        out[case] = dict(
            loss=abs(float(loss - ref_loss)), grad=float((full_grad - ref_grad).abs().max()),
            grad_finite=bool(torch.isfinite(grad).all()), ref_loss=float(ref_loss),
            rows_with_grad=(ref_grad.abs().sum(1) > 0).tolist(),
            metrics=_max_diff(_group_metrics(metrics, group), ref_metrics),
            totals=_max_diff(summed, {k: v.double() for k, v in ref_totals.items()}),
            plain=max(abs(float(plain_loss - ref_loss)),
                      float((context.all_gather(plain_grad, group) - ref_grad).abs().max())))
    return out


@pytest.mark.slow
@pytest.mark.mcore019
def test_losses_reduced_over_two_cp_ranks_equal_one_process():
    results = run_distributed(_cp_worker, world_size=2, timeout=300)
    for rank, res in enumerate(results):
        assert res["sizes"] == (2, 1, 2, 4)
        assert res["megatron_split"] and res["all_gather"]
        assert res["masked_rows"] >= 1  # the sequence-level MIS case masks a row
        for case in CASES:
            r = res[case]
            assert r["loss"] <= 1e-5 * max(1.0, abs(r["ref_loss"])), (rank, case, r)
            assert r["grad"] <= 1e-5 and r["grad_finite"], (rank, case, r)
            assert r["metrics"] <= 1e-5 and r["totals"] <= 1e-5, (rank, case, r)
    # GSPO clips rows 0 and 1 (whole rows), row 4 trains nothing, row 5 only in rank 0's chunk
    assert results[0]["gspo"]["rows_with_grad"] == [False, False, True, True, False, True]
    # Without the reduction the split rows give another loss or gradient: the test can fail.
    for case in CASES:
        assert max(res[case]["plain"] for res in results) > 1e-3, case


# --- (c) where CP cannot run ----------------------------------------------------------------------
def test_layout_counts_context_in_the_world_and_the_config():
    layout = ParallelLayout(tensor=2, context=2)
    layout.validate(8, num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=512)
    assert layout.data_parallel(8) == 2 and layout.describe(8) == "TP2xPP1xCP2xEP1xETP2xDP2"
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tensor x pipeline x "
                                          r"context = 2 x 1 x 2 = 4"):
        layout.validate(6, num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=512)
    with pytest.raises(LayoutError, match="parallel.context must be >= 1, got 0"):
        ParallelLayout(context=0).validate_sizes()
    fields = layout.transformer_config_fields(is_moe=True)
    assert fields["context_parallel_size"] == 2 and fields["cp_comm_type"] == "p2p"
    assert "cp_comm_type" not in ParallelLayout().transformer_config_fields(is_moe=True)
    layout.check_context_parallel(transformer_engine=True, cuda=True, half=True)
    ParallelLayout().check_context_parallel(transformer_engine=False, cuda=False, half=False)
    for te, cuda in ((False, True), (True, False), (False, False)):
        with pytest.raises(LayoutError, match=CP_ERROR):
            ParallelLayout(context=2).check_context_parallel(transformer_engine=te, cuda=cuda, half=True)
    # TE has no fp32 attention kernel with CP (it would fail at the first forward, after start-up)
    with pytest.raises(LayoutError, match="parallel.context=2 needs model.dtype=bfloat16"):
        layout.check_context_parallel(transformer_engine=True, cuda=True, half=False)


def test_megatron_config_takes_the_layout_fields():
    """TransformerConfig accepts what the layout sets (built here without the TE spec, which is
    what the actor refuses to run)."""
    from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
    from model_specs import model_spec_for
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    layout = ParallelLayout(context=2)
    fields = {**layout.transformer_config_fields(is_moe=True), **cpu_config_overrides(1)}
    c = model_spec_for(tiny_hf_config(), overrides=fields, transformer_engine=False).config
    assert c.context_parallel_size == 2 and c.cp_comm_type == "p2p"


def test_actor_spec_refuses_context_parallel_without_te_on_cuda():
    from gspo_megatron.actor.build import spec_for_layout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    with pytest.raises(LayoutError, match=CP_ERROR):
        spec_for_layout(tiny_hf_config(), ParallelLayout(context=2))


def test_routing_tools_are_off_under_context_parallelism():
    from gspo_megatron.actor.settings import RoutingSettings
    assert not RoutingSettings().resolve(is_moe=True, recompute=True, context_parallel=2).drift
    assert RoutingSettings().resolve(is_moe=True, recompute=True).drift
    with pytest.raises(ValueError, match="not supported with parallel.context=2"):
        RoutingSettings(drift=True).resolve(is_moe=True, recompute=True, context_parallel=2)


def test_run_config_error_at_start(capsys, tmp_path):
    """On this CPU machine: one line naming the setting, before anything is written or started."""
    from fixtures_models import tiny_model_dir
    from gspo_megatron.cli import main
    assert main(["train", "examples/tiny_moe_larger_digit.yaml", "--set",
                 f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}", "--set",
                 f"checkpoint.dir={tmp_path / 'ck'}", "--set", "parallel.context=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"gspo-megatron: error: {CP_ERROR}"
    assert not (tmp_path / "ck").exists()
