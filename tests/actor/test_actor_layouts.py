"""Every parallel layout gives the one-process per-token log-probs and, after
each GSPO optimizer step, the one-process parameters (1e-5), on real gloo process groups.

One spawn per layout does what the trainer does: load the reference's initial weights, shard a
rollout batch of 11 rows (uneven lengths, holes in the loss mask, one row with nothing to train)
into 2 mini-batches over the DP ranks (uneven rows and trained tokens per rank), recompute old
log-probs (forward only, kept on the last stage), then one train step per mini-batch. The reference
is the same Actor on one process with one micro-batch per mini-batch (the full-batch gradient).

The optimizer is Adam with eps = 10, far above every |gradient|, and no clipping: the update
lr * m / (sqrt(v) + eps) is then ~ lr * g / eps, linear in the gradient, so a wrong loss scale (the
"off by dp_size" / "off by num_microbatches" bugs) moves the parameters by ~the step itself, far
beyond 1e-5. (Adam's usual first step, ~lr * sign(g), and gradient clipping would hide a wrong
scale; megatron's distributed optimizer supports only Adam, hence not SGD.)
test_wrong_scale_is_caught proves the comparison catches it. Step 1 is on-policy (s = 1); step 2 runs after an update, so ratios move
and some sequences are clipped (eps 0.2 / 0.27 here: with the paper's 3e-4 / 4e-4 every sequence
would clip after an SGD step this large and the step would be trivially zero).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import gather_row_values, run_distributed

pytestmark = pytest.mark.slow

ROWS, SEQ, MINI = 11, 24, 2
TOL = 1e-5
# The skewed batch: RL's long tail in small, 4 mini-batches of 8 rows, each with two
# rows 3-5x longer than the rest. Cut by row count, a DP rank gets both long rows of a
# mini-batch; balanced by work (actor/batching/balance.py, the default) it does not.
SKEWED: dict[str, Any] = dict(rows=32, mini=4, lengths=[6, 7, 5, 22, 6, 7, 7, 22, 5, 5, 7, 24, 7, 24, 7, 5,
                                        6, 21, 23, 7, 7, 7, 6, 6, 21, 21, 6, 5, 7, 6, 6, 5])


def shape(options: dict) -> tuple[int, int]:
    """(rows, mini-batches) of the batch a test trains."""
    return (SKEWED["rows"], SKEWED["mini"]) if options.get("skewed") else (ROWS, MINI)


def make_batch(skewed: bool = False):
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    rows = SKEWED["rows"] if skewed else ROWS
    lengths = torch.randint(6, SEQ + 1, (rows,), generator=g)
    if skewed:
        lengths = torch.tensor(SKEWED["lengths"])
    prompt = torch.randint(2, 5, (rows,), generator=g)
    t = torch.arange(SEQ)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(0, 512, (rows, SEQ), generator=g), 0)
    mask = (t >= prompt[:, None]) & (t < lengths[:, None]) & (torch.rand(rows, SEQ, generator=g) > 0.2)
    mask[3] = False  # a row without trained tokens: excluded from the mean, never NaN
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                      advantages=torch.randn(rows, generator=g),
                      rollout_log_probs=-6.0 + 0.1 * torch.randn(rows, SEQ, generator=g))


def _np(state):
    return None if state is None else {k: v.numpy() for k, v in state.items()}


def _run(rank, world, layout_kwargs, options, init_state):
    """One layout on `world` ranks; returns what rank 0 / the last stage saw, as numpy."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor import steps as actor_steps
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import LogProbSettings, MicroBatchSettings, OptimizerSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3, qwen3_moe

    if options.get("wrong_scale"):  # the classic bug: forget the DP factor of the loss scale
        actor_steps.ps = type("PS", (), {"__getattr__": lambda self, n: getattr(ps, n),
                                         "get_data_parallel_world_size": staticmethod(lambda: 1)})()
    tiny_hf_config = qwen3 if options.get("dense") else qwen3_moe
    actor = Actor(tiny_hf_config(), ParallelLayout(**layout_kwargs),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0,
                                              use_distributed_optimizer=options.get("dist_opt", False)),
                  loss=LossSettings(name="gspo", eps_low=0.02, eps_high=0.002),
                  logprob=LogProbSettings(fused=options.get("fused", True), chunk_tokens=40),
                  batching=MicroBatchSettings(micro_batch_size=options.get("micro_batch_size", 2),
                                              max_tokens_per_micro_batch=options.get("max_tokens"),
                                              dp_balance=options.get("dp_balance", "flops")),
                  seed=11 + rank)
    made_init = None
    if init_state is None:
        made_init = _np(actor.full_state_dict())
    else:
        actor.load_full_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    batch = make_batch(options.get("skewed", False))
    if options.get("packed_rows"):  # the trainer's form (samples_to_batch, transfer): real tokens only
        batch = batch.packed()
    shard = actor.shard(batch, num_mini_batches=shape(options)[1])
    assert shard.is_packed == bool(options.get("packed_rows"))
    shard.old_log_probs, old_metrics = actor.compute_old_log_probs(shard)
    metrics = [old_metrics]
    keeps_old = actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
    old = (shard.global_rows.numpy(), shard.padded().old_log_probs.numpy()) if keeps_old else None
    if actor.is_last_stage:
        assert shard.old_log_probs is not None
    else:
        assert shard.old_log_probs is None  # log-probs never leave the last stage
    states = []
    for mini in shard.mini_batches():
        metrics.append(actor.train_step(mini))
        states.append(_np(actor.full_state_dict(to_all_ranks=False)))
    return dict(old=old, metrics=metrics, states=states if rank == 0 else None,
                init=made_init if rank == 0 else None, imbalance=shard.dp_token_imbalance,
                tokens=[int(m.lengths.sum()) for m in shard.mini_batches()])


@pytest.fixture(scope="session")
def reference():
    return run_distributed(_run, 1, ({}, {"micro_batch_size": 64}, None), timeout=180)[0]


@pytest.fixture(scope="session")
def skewed_reference():
    return run_distributed(_run, 1, ({}, {"micro_batch_size": 64, "skewed": True}, None), timeout=180)[0]


@pytest.fixture(scope="session")
def dense_reference():
    return run_distributed(_run, 1, ({}, {"micro_batch_size": 64, "dense": True}, None), timeout=180)[0]


def _max_state_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(float(abs(torch.from_numpy(a[k]) - torch.from_numpy(b[k])).max()) for k in a)


def _check_layout(reference, world, layout, **options):
    results = run_distributed(_run, world, (layout, options, reference["init"]), timeout=420)
    batch = make_batch(options.get("skewed", False))
    rows = batch.num_rows
    valid = (torch.arange(SEQ)[None] >= 1) & (torch.arange(SEQ)[None] < batch.lengths[:, None])
    got = gather_row_values([r["old"] for r in results], rows, SEQ)
    want = gather_row_values([reference["old"]], rows, SEQ)
    assert not got[valid].isnan().any(), "some rows' old log-probs were not computed"
    assert float((got - want)[valid].abs().max()) <= TOL
    moved = _max_state_diff(reference["states"][0], reference["init"])
    assert moved > 1e-2, "the reference step is too small to detect a wrong gradient scale"
    for step, (mine, ref) in enumerate(zip(results[0]["states"], reference["states"])):
        assert _max_state_diff(mine, ref) <= TOL, f"parameters after step {step + 1}"
    for step, (mine, ref) in enumerate(zip(results[0]["metrics"], reference["metrics"])):
        for key in ("loss", "grad_norm", "clip_fraction", "seq_ratio_min", "seq_ratio_max",
                    "entropy_mean", "logprob_abs_diff_vs_rollout", "tokens", "num_sequences"):
            if key in ref:
                assert mine[key] == pytest.approx(ref[key], rel=TOL, abs=TOL), (step, key)
    assert all(r["metrics"] == results[0]["metrics"] for r in results)  # the same on every rank
    assert 0 < reference["metrics"][2]["clip_fraction"] < 1, "step 2 should clip some sequences"
    return results


def test_logprobs_tp2(reference):
    _check_layout(reference, 2, dict(tensor=2))  # MoE with TP2 runs sequence parallel


# PP2 and EP2 x DP2 (with the distributed optimizer) on their own: test_token_budget_micro_batches
# below; with the padded micro-batches: test_logprobs_pp2_vpp2 and test_logprobs_tp2_pp2_ep2.


# DP2 and DP4 on the skewed batch with 4 mini-batches (4 optimizer steps), shared by work
# (Karmarkar-Karp on FLOPs, the default) and under a token budget: the one-process log-probs,
# parameters, loss and gradient norm; and the work is even where row counts would not be.
@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "dp4"])
def test_skewed_lengths_balanced_by_work_equal_one_process(skewed_reference, world):
    # The shards packed (the trainer's form) against the padded one-process reference.
    results = _check_layout(skewed_reference, world, dict(), skewed=True, micro_batch_size=4, max_tokens=48,
                            packed_rows=True)
    from gspo_megatron.actor.batching.balance import plan_shards, token_imbalance
    lengths = SKEWED["lengths"]
    by_rows = max(token_imbalance(lengths, parts) for parts in plan_shards(len(lengths), world, SKEWED["mini"]))
    got = results[0]["imbalance"]
    assert all(r["imbalance"] == got for r in results)
    assert got < 1.2 < by_rows, (got, by_rows)
    per_rank = [r["tokens"] for r in results]  # [rank][mini-batch]: the real tokens each rank trained
    worst = max(max(column) / (sum(column) / world) for column in zip(*per_rank))
    assert worst == pytest.approx(got)  # the metric is what the ranks computed


@pytest.mark.mcore019  # also against megatron-core 0.19.2: the interleaved schedule
def test_logprobs_pp2_vpp2(reference):
    # Also the logits path (the others use the fused one); fixed shapes on gloo, see build.py.
    _check_layout(reference, 2, dict(pipeline=2, virtual_pipeline=2), fused=False)


@pytest.mark.mcore019  # also against megatron-core 0.19.2: every parallelism at once
def test_logprobs_tp2_pp2_ep2(reference):
    # 8 ranks: TP2 x PP2 x DP2, EP2 x expert-TP2, distributed optimizer.
    _check_layout(reference, 8, dict(tensor=2, pipeline=2, expert=2), dist_opt=True)


def test_logprobs_tp2_dense(dense_reference):
    # Dense Qwen3: TP without sequence parallelism (replicated hidden states on the last stage).
    _check_layout(dense_reference, 2, dict(tensor=2), dense=True)


def test_wrong_scale_is_caught(reference):
    with pytest.raises(AssertionError, match="parameters after step 1"):
        _check_layout(reference, 2, dict(), wrong_scale=True)


# --- token-budget micro-batches (policy-update throughput) ---------------------------------
# Rows grouped longest first up to 48 computed tokens (rows are 6-24 tokens long): micro-batches of
# different row counts and lengths, a different count per DP rank before agreement. The result
# must still equal one process with one micro-batch (the padded path), and the budget must hold.
BUDGET = 48


# PP2 (micro-batches of different shapes through the pipeline schedule) and EP2 x DP2 (two DP ranks
# that agree on a count, experts across them); TP2 and plain DP2 add no path of their own.
# EP2 x DP2 also keeps the rows cut by row count (train.dp_balance=rows, the rows-by-count layout),
# with the distributed optimizer.
@pytest.mark.parametrize("layout,dist_opt", [(dict(pipeline=2), False), (dict(expert=2), True)], ids=["pp2", "ep2"])
def test_token_budget_micro_batches(reference, layout, dist_opt):
    results = _check_layout(reference, 2, layout, micro_batch_size=8, max_tokens=BUDGET, dp_balance="rows",
                            dist_opt=dist_opt)
    for step in results[0]["metrics"]:
        assert step["max_micro_batch_tokens"] <= BUDGET
        assert 0.0 <= step["padding_fraction"] < 0.5
    assert max(step["num_microbatches"] for step in results[0]["metrics"]) > 1
