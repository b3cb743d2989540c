"""Against verl's own formulas (verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py,
volcengine/verl at b178a3cd5), transcribed here independently of the code under test: the
estimators (grpo with and without the std, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline),
the KL in the reward (ray_trainer.apply_kl_penalty), kl_penalty's estimators, agg_loss's modes and
the vanilla (dual-clip) and GSPO policy losses. Values and gradients in fp64 within 1e-12, on
random ragged batches with empty rows and groups of equal rewards."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from gspo_megatron.algorithms import grpo_loss, gspo_loss, gspo_token_loss
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.algorithms.kl import token_kl
from gspo_megatron.algorithms.terms import Aggregation
from peer_cases import F64, make_case, outcome_rewards

TOL = dict(rtol=0, atol=1e-12)
SEEDS = [0, 1, 2]


# --- verl, transcribed -----------------------------------------------------------------------
# verl's masked_mean divides by (count + 1e-8), a guard that moves a mean by 1e-8 / count of itself
# (~1e-10 here): the transcriptions take it as a parameter, 0 for the 1e-12 comparisons, and
# test_the_guards_move_values_by_their_size shows it is all that differs.
GUARD = 1e-8


def masked_mean(v, m, axis=None, guard=0.0):
    return (torch.where(m.bool(), v, 0.0) * m).sum(axis) / (m.sum(axis) + guard)


def masked_whiten(v, m, guard=0.0):
    mean = masked_mean(v, m, guard=guard)
    var = masked_mean((v - mean) ** 2, m, guard=guard) * (m.sum() / (m.sum() - 1))
    return (v - mean) * torch.rsqrt(var + 1e-8)


def verl_grpo(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    mean, std = {}, {}
    for idx, s in id2score.items():
        mean[idx], std[idx] = (torch.tensor(0.0), torch.tensor(1.0)) if len(s) == 1 else \
            (torch.mean(torch.stack(s)), torch.std(torch.stack(s)))
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon) if norm_adv_by_std_in_grpo \
            else scores[i] - mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma, guard=0.0):
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return masked_whiten(returns, response_mask, guard) * response_mask


def verl_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index, guard=0.0):
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return masked_whiten(scores, response_mask, guard) * response_mask


def verl_kl_penalty(logprob, ref_logprob, kind):
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # "low_var_kl", "k3"
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None, guard=0.0):
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        seq = (loss_mat * loss_mask).sum(-1)
        valid = (loss_mask.sum(-1) > 0).to(seq.dtype)
        return (seq * valid).sum() / valid.sum()
    if mode == "seq-mean-token-mean":
        n = loss_mask.sum(-1)
        seq = (loss_mat * loss_mask).sum(-1) / torch.where(n > 0, n + guard, 1.0)  # empty rows: 0 * valid
        valid = (n > 0).to(seq.dtype)
        return (seq * valid).sum() / valid.sum()
    seq = (loss_mat * loss_mask).sum(-1)  # seq-mean-token-sum-norm
    return seq.sum() / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])


def verl_vanilla(old, lp, adv, mask, clip_low, clip_high, clip_ratio_c, mode, loss_scale_factor=None):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-adv * clip_ratio_c, clip1)
    return verl_agg_loss(torch.where(adv < 0, clip2, clip1), mask, mode, loss_scale_factor)


def verl_gspo(old, lp, adv, mask, clip_low, clip_high, guard=0.0):
    seq_lengths = mask.sum(-1).clamp(min=1)
    kl_seq = ((lp - old) * mask).sum(-1) / seq_lengths
    log_ratio = torch.clamp(lp - lp.detach() + kl_seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return verl_agg_loss(pg, mask, "seq-mean-token-mean", guard=guard)


# --- the comparisons ----------------------------------------------------------------------------
def ours(case, settings, kl=None):
    lengths, loss_mask = case.packed
    rows = BatchRows(lengths, loss_mask, torch.tensor(case.index), max(case.index) + 1)
    adv, _ = batch_advantages(settings, case.rewards, rows, kl=None if kl is None else case.from_peer(kl))
    return adv.double()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator,std", [("grpo", True), ("dr_grpo", False)])
def test_grpo_and_dr_grpo(seed, estimator, std):
    case = make_case(seed)
    want = verl_grpo(outcome_rewards(case), case.mask, case.index, norm_adv_by_std_in_grpo=std)
    got = ours(case, AdvantageSettings(advantage_estimator=estimator,
                                       estimator_args={"group_std": "unbiased"} if std else {}))
    torch.testing.assert_close(got[:, None] * case.mask, want, **TOL)
    assert torch.equal(got[:case.group_size], torch.zeros(case.group_size, dtype=F64))  # equal rewards


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo(seed):
    case = make_case(seed)
    want = verl_rloo(outcome_rewards(case), case.mask, case.index)
    got = ours(case, AdvantageSettings(advantage_estimator="rloo"))
    torch.testing.assert_close(got[:, None] * case.mask, want, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(seed, gamma):
    case = make_case(seed)
    want = verl_reinforce_plus_plus(outcome_rewards(case), case.mask, gamma)
    got = ours(case, AdvantageSettings(advantage_estimator="reinforce_plus_plus", estimator_args={"gamma": gamma}))
    got = case.to_peer(got) if got.numel() != case.rewards.numel() else got[:, None] * case.mask
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(seed):
    case = make_case(seed)
    want = verl_reinforce_plus_plus_baseline(outcome_rewards(case), case.mask, case.index)
    got = ours(case, AdvantageSettings(advantage_estimator="reinforce_plus_plus_baseline"))
    torch.testing.assert_close(got[:, None] * case.mask, want, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_kl_in_reward(seed, estimator, kind):
    """apply_kl_penalty: token_level_rewards = scores - beta * kl_penalty(old, ref) * mask."""
    case = make_case(seed)
    beta = 0.05
    kld = verl_kl_penalty(case.old_log_probs, case.ref_log_probs, kind) * case.mask
    rewards = outcome_rewards(case) - beta * kld
    want = {"grpo": lambda: verl_grpo(rewards, case.mask, case.index),
            "rloo": lambda: verl_rloo(rewards, case.mask, case.index),
            "reinforce_plus_plus": lambda: verl_reinforce_plus_plus(rewards, case.mask, 1.0)}[estimator]()
    settings = AdvantageSettings(advantage_estimator=estimator, kl_in_reward_coef=beta,
                                 estimator_args={"group_std": "unbiased"} if estimator == "grpo" else {},
                                 kl_in_reward_estimator=kind)
    got = ours(case, settings, kl=token_kl(case.old_log_probs, case.ref_log_probs, kind))
    got = case.to_peer(got) if got.numel() != case.rewards.numel() else got[:, None] * case.mask
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind,ours_name", [("k1", "k1"), ("kl", "k1"), ("abs", "abs"), ("mse", "k2"),
                                            ("k2", "k2"), ("k3", "low_var_kl"), ("low_var_kl", "low_var_kl")])
def test_kl_estimators(kind, ours_name):
    case = make_case(0, ratio_scale=6.0)  # large log-ratios: the clamp at 10 acts
    x = case.log_probs.clone().requires_grad_(True)
    y = case.log_probs.clone().requires_grad_(True)
    want = verl_kl_penalty(x, case.ref_log_probs, kind)
    got = token_kl(y, case.ref_log_probs, ours_name)
    torch.testing.assert_close(got, want, **TOL)
    (gw,) = torch.autograd.grad((want * case.mask).sum(), x)
    (gg,) = torch.autograd.grad((got * case.mask).sum(), y)
    torch.testing.assert_close(gg, gw, **TOL)
    if kind == "k3":
        assert float(want.max()) == 10.0  # verl's k3 is the clamped one: ours low_var_kl


def _loss_and_grad(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_(True)
    loss = fn(x, *args, **kw)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_vanilla_dual_clip_loss_every_aggregation(seed, mode, token_adv):
    """verl compute_policy_loss_vanilla (clip_ratio_c = 3) + agg_loss = grpo_loss with dual_clip_c."""
    case = make_case(seed, ratio_scale=0.6)  # ratios past 1.27, and past c = 3 on a negative advantage:
    row = int(torch.nonzero((case.rewards < 0) & (case.lengths > 1))[0])
    case.log_probs[row, :2] = case.old_log_probs[row, :2] + 1.5
    adv = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) if token_adv \
        else case.rewards[:, None].expand_as(case.mask)
    c_norm = 7.0 if mode == "seq-mean-token-sum-norm" else None
    lw, gw = _loss_and_grad(lambda x: verl_vanilla(case.old_log_probs, x, adv, case.mask, 0.2, 0.27, 3.0, mode,
                                                    c_norm), case.log_probs)
    kw = dict(token_sum_norm=c_norm) if c_norm else {}
    lo, go = _loss_and_grad(grpo_loss, case.log_probs, case.old_log_probs, adv if token_adv else case.rewards,
                            case.mask.bool(), dual_clip_c=3.0, loss_agg_mode=Aggregation.of(mode, kw))
    if mode == "seq-mean-token-sum-norm":  # verl: no mean over sequences (ours: Dr. GRPO's 1/N)
        n = float((case.lengths > 0).sum())
        lw, gw = lw / n, gw / n
    torch.testing.assert_close(lo, lw, **TOL)
    torch.testing.assert_close(go, gw, **TOL)
    ratio = torch.exp(case.log_probs - case.old_log_probs)
    assert token_adv or bool(((adv < 0) & (ratio > 3.0) & case.mask.bool()).any())  # the dual clip acts


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("token_adv", [False, True])
def test_gspo_loss(seed, token_adv):
    """verl compute_policy_loss_gspo (token form, seq-mean-token-mean) = gspo (per-row advantages)
    and gspo_token (per-token ones)."""
    case = make_case(seed, ratio_scale=0.01)
    adv = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) if token_adv \
        else case.rewards[:, None].expand_as(case.mask)
    lw, gw = _loss_and_grad(lambda x: verl_gspo(case.old_log_probs, x, adv, case.mask, 3e-4, 4e-4), case.log_probs)
    fn, a = (gspo_token_loss, adv) if token_adv else (gspo_loss, case.rewards)
    lo, go = _loss_and_grad(fn, case.log_probs, case.old_log_probs, a, case.mask.bool())
    torch.testing.assert_close(lo, lw, **TOL)
    torch.testing.assert_close(go, gw, **TOL)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind,ours_name", [("low_var_kl", "low_var_kl"), ("k1", "k1"), ("k2", "k2")])
def test_kl_loss_term_follows_the_aggregation(mode, kind, ours_name):
    """dp_actor: policy_loss + kl_loss_coef * agg_loss(kl_penalty(log_prob, ref), mask, mode)."""
    case = make_case(3, ratio_scale=0.3)
    adv = case.rewards[:, None].expand_as(case.mask)

    def verl(x):
        kl = verl_agg_loss(verl_kl_penalty(x, case.ref_log_probs, kind), case.mask, mode)
        return verl_vanilla(case.old_log_probs, x, adv, case.mask, 0.2, 0.27, 3.0, mode) + 0.1 * kl
    lw, gw = _loss_and_grad(verl, case.log_probs)
    lo, go = _loss_and_grad(grpo_loss, case.log_probs, case.old_log_probs, case.rewards, case.mask.bool(),
                            dual_clip_c=3.0, loss_agg_mode=mode, ref_log_probs=case.ref_log_probs, kl_coef=0.1,
                            kl_estimator=ours_name)
    torch.testing.assert_close(lo, lw, **TOL)
    torch.testing.assert_close(go, gw, **TOL)


def test_equal_random_rewards_are_exactly_zero_here():
    """A group of equal rewards that are not exact in binary: verl's `r - mean` leaves rounding
    (up to ~1e-10 after the division by 1e-6); ours is 0 by the equality check, never NaN."""
    case = make_case(0)
    case.rewards[:case.group_size] = 0.3
    want = verl_grpo(outcome_rewards(case), case.mask, case.index)
    got = ours(case, AdvantageSettings(estimator_args={"group_std": "unbiased"}))
    assert torch.equal(got[:case.group_size], torch.zeros(case.group_size, dtype=F64))
    assert float(want[:case.group_size].abs().max()) < 1e-9


def test_the_guards_move_values_by_their_size():
    """verl's (count + 1e-8) denominators, left out of the comparisons above, move a whitened
    advantage or a sequence mean by about 1e-8 / count of its size, and nothing else differs."""
    case = make_case(0)
    plain = verl_reinforce_plus_plus(outcome_rewards(case), case.mask, 1.0)
    guarded = verl_reinforce_plus_plus(outcome_rewards(case), case.mask, 1.0, guard=GUARD)
    assert 0 < float((plain - guarded).abs().max()) < 1e-9
    adv = case.rewards[:, None].expand_as(case.mask)
    a = verl_gspo(case.old_log_probs, case.log_probs, adv, case.mask, 3e-4, 4e-4)
    b = verl_gspo(case.old_log_probs, case.log_probs, adv, case.mask, 3e-4, 4e-4, guard=GUARD)
    assert 0 < abs(float(a - b)) < 1e-9
