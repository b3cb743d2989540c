"""docs/algorithm.md property 11 in its single-process form: reduction="sum" over uneven chunks, divided by the
global number of units (valid sequences, or trained tokens for token-mean), equals reduction="mean" on the
whole batch (value, gradient and metrics), also under megatron-core's schedule contract (divide by
micro-batches, average over DP). Every RL loss of the LOSSES table, with every aggregation its row lists:
a new row is tested without an edit here."""
import pytest
import torch

from gspo_megatron.algorithms import (LOSS_FUNCTIONS, METRIC_REDUCTIONS, combine_metrics, grpo_loss, gspo_loss,
                                     gspo_token_loss)
from gspo_megatron.algorithms.registry import LOSSES
from gspo_megatron.algorithms.terms import Aggregation

F64 = torch.float64
# (loss name, aggregation): every mode a row takes
RL_LOSSES = [n for n, row in LOSSES.items() if row.rl]
CASES = [(n, mode) for n in RL_LOSSES for mode in LOSSES[n].aggregation_names()]


def global_batch(name, b=13, s=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=F64) * 2
    # a spread of log-ratios: some rows clipped by GSPO's 3e-4/4e-4, some not
    lp = old + torch.randn(b, 1, generator=g, dtype=F64) * 4e-4 + torch.randn(b, s, generator=g, dtype=F64) * 1e-4
    lengths = torch.randint(0, s + 1, (b,), generator=g)
    lengths[[2, 3, 4]] = 0  # empty rows, a whole chunk of them below
    mask = torch.arange(s)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=F64)
    if LOSSES[name].advantages == "token":
        adv = adv[:, None] * (1 + torch.rand(b, s, generator=g, dtype=F64))
    ref = old + 0.1 * torch.randn(b, s, generator=g, dtype=F64)
    return lp, old, adv, mask, ref


def options(name, mode):
    """The loss's keyword arguments: GSPO's clip range for every loss that clips (GRPO's 0.2 would
    clip nothing at these ratios: the split must cross clip decisions), and the aggregation."""
    kw = dict(eps_low=3e-4, eps_high=4e-4) if LOSSES[name].clip is not None else {}
    if mode != "seq-mean-token-mean":
        kw["loss_agg_mode"] = Aggregation.of(mode, {"token_sum_norm": 7.0} if mode == "seq-mean-token-sum-norm" else {})
    return kw


def units(mask, mode):
    """What the loss is a mean over: trained tokens (token-mean) or rows with one."""
    return int(mask.sum()) if mode == "token-mean" else int(mask.any(-1).sum())


CHUNKS = [2, 3, 1, 5, 2]  # uneven; the second chunk holds only empty rows


def chunked(total, sizes):
    start = 0
    for n in sizes:
        yield slice(start, start + n)
        start += n
    assert start == total


@pytest.mark.parametrize("name,mode", CASES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_sum_over_uneven_chunks_equals_full_batch_mean(name, mode, kl_coef):
    fn = LOSS_FUNCTIONS[name]
    lp, old, adv, mask, ref = global_batch(name)
    kw = options(name, mode)
    kl = dict(kl_coef=kl_coef) if kl_coef else {}
    x = lp.clone().requires_grad_(True)
    full, full_m = fn(x, old, adv, mask, **kw, **(dict(ref_log_probs=ref, **kl) if kl_coef else {}))
    (full_grad,) = torch.autograd.grad(full, x)
    if LOSSES[name].clip is not None:
        assert 0 < full_m["clipped_tokens"] < full_m["num_tokens"]  # the split crosses clip decisions

    n_units = units(mask, mode)
    y = lp.clone().requires_grad_(True)
    total, metrics = 0.0, []
    for sl in chunked(lp.shape[0], CHUNKS):
        extra = dict(ref_log_probs=ref[sl], **kl) if kl_coef else {}
        loss_sum, m = fn(y[sl], old[sl], adv[sl], mask[sl], reduction="sum", **kw, **extra)
        (loss_sum / n_units).backward()
        total = total + loss_sum.detach() / n_units
        metrics.append(m)
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(y.grad, full_grad)
    combined = combine_metrics(metrics)
    assert combined.keys() == full_m.keys()
    for k in full_m:
        torch.testing.assert_close(combined[k], full_m[k], msg=k)


@pytest.mark.parametrize("name,mode", CASES)
def test_megatron_schedule_contract_dp2_uneven_microbatches(name, mode):
    """Rank r runs M_r micro-batches; the schedule divides each loss by M_r and DP averages the ranks'
    gradients. Scaling the summed loss by M_r * dp / N_global undoes both exactly."""
    fn = LOSS_FUNCTIONS[name]
    lp, old, adv, mask, _ = global_batch(name, seed=1)
    kw = options(name, mode)
    x = lp.clone().requires_grad_(True)
    (full_grad,) = torch.autograd.grad(fn(x, old, adv, mask, **kw)[0], x)
    n_global = units(mask, mode)
    ranks = [[slice(0, 4), slice(4, 5), slice(5, 9)], [slice(9, 10), slice(10, 13)]]  # DP2, 3 and 2 micro-batches
    dp = len(ranks)
    rank_grads = []
    for micro_batches in ranks:
        y = lp.clone().requires_grad_(True)
        for sl in micro_batches:
            loss_sum, _ = fn(y[sl], old[sl], adv[sl], mask[sl], reduction="sum", **kw)
            scaled = loss_sum * len(micro_batches) * dp / n_global  # what the actor hands the schedule
            (scaled / len(micro_batches)).backward()                 # what the schedule backprops
        rank_grads.append(y.grad)
    torch.testing.assert_close(sum(rank_grads) / dp, full_grad)   # DP all-reduce average


def test_aggregations_a_row_does_not_list_are_refused_by_name():
    """The built-in losses take every mode; a plug-in row that lists only the default (LossSpec's
    default) is refused any other, by the config, naming the loss."""
    from gspo_megatron.algorithms.registry import LossSettings, LossSpec
    toy = LossSpec("toy_seq", "gspo_megatron.algorithms.gspo:gspo_loss", (3e-4, 4e-4), "sequence", ("num_sequences",),
                   "a plug-in that computes only GSPO's own aggregation")
    assert all(LOSSES[name].aggregations is None for name in RL_LOSSES)
    with LOSSES.registered(toy):
        assert LossSettings(name="toy_seq").loss_agg_mode == "seq-mean-token-mean"
        with pytest.raises(ValueError, match="loss_agg_mode='token-mean': expected seq-mean-token-mean with the "
                                             "toy_seq loss"):
            LossSettings(name="toy_seq", loss_agg_mode="token-mean")


@pytest.mark.parametrize("loss", [grpo_loss, gspo_loss])
def test_token_sums_weigh_rows_by_length_and_the_means_do_not(loss):
    """What the modes mean, on two rows of lengths 1 and 3 with one advantage each, on-policy
    (every token's term is -A, GSPO's with its sequence ratio on each token, as ROLL's seq):
    seq-mean-token-mean -mean(A); seq-mean-token-sum -(A0 + 3 A1) / 2; seq-mean-token-sum-norm that
    over C; token-mean -(A0 + 3 A1) / 4."""
    lp = torch.zeros(2, 4, dtype=F64)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    want = {"seq-mean-token-mean": 0.5, "seq-mean-token-sum": 2.5, "seq-mean-token-sum-norm": 2.5 / 4,
            "token-mean": 5 / 4}
    for mode, value in want.items():
        kw = dict(token_sum_norm=4.0) if mode.endswith("norm") else {}
        got, _ = loss(lp, lp, adv, mask, loss_agg_mode=Aggregation.of(mode, kw))
        assert float(got) == pytest.approx(value, abs=1e-15), mode


def test_metric_reduction_table_covers_every_summable_key():
    lp, old, adv, mask, ref = global_batch("gspo")
    _, m = gspo_loss(lp, old, adv, mask, ref_log_probs=ref)
    derived = {"clip_fraction", "token_clip_fraction", "seq_ratio_mean", "kl"}
    assert set(m) == set(METRIC_REDUCTIONS) | derived
    for v in m.values():
        assert not v.requires_grad and v.dim() == 0 and v.is_floating_point()
    with pytest.raises(ValueError, match="needs at least one"):
        combine_metrics([])
    # every RL loss of the table, the shipped ones with their functions (a new row needs no edit here)
    assert set(LOSS_FUNCTIONS) == set(RL_LOSSES)
    assert {n: LOSS_FUNCTIONS[n] for n in ("gspo", "gspo_token", "grpo")} == {
        "gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}


def test_algorithms_import_no_megatron():
    import subprocess
    import sys
    code = ("import sys, gspo_megatron.algorithms; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
