"""Against slime's own formulas (slime/utils/ppo_utils.py compute_approx_kl, compute_policy_loss,
compute_gspo_kl, get_reinforce_plus_plus_returns, get_reinforce_plus_plus_baseline_advantages;
slime/ray/rollout.py _post_process_rewards; slime/utils/distributed_utils.py
distributed_masked_whiten; THUDM/slime at 624b824a8), transcribed here independently of the code
under test. Values and gradients in fp64 within 1e-12 on random ragged batches. slime's loss is
the per-sample mean (seq-mean-token-mean) unless --calculate-per-token-loss (token-mean)."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms import grpo_loss, gspo_loss
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.algorithms.kl import token_kl
from peer_cases import F64, make_case

TOL = dict(rtol=0, atol=1e-12)
SEEDS = [0, 1, 2]


# --- slime, transcribed ----------------------------------------------------------------------
def slime_approx_kl(log_probs, log_probs_base, kl_loss_type):
    log_ratio = log_probs - log_probs_base
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio ** 2 / 2.0
    else:  # k3, low_var_kl
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def slime_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    ratio = (-ppo_kl).exp()
    pg1 = -ratio * advantages
    pg2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip1 = torch.maximum(pg1, pg2)
    if eps_clip_c is None:
        return clip1
    return torch.where(advantages < 0, torch.min(-eps_clip_c * advantages, clip1), clip1)


def slime_group_norm(rewards, n_samples, std_normalization=True):
    r = rewards.reshape(-1, n_samples)
    r = r - r.mean(dim=-1, keepdim=True)
    if std_normalization:
        r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return r.flatten()


def slime_distributed_masked_whiten(values, mask):
    total, total_sq, count = (values * mask).sum(), ((values ** 2) * mask).sum(), mask.sum()
    mean = total / count
    var = (total_sq / count - mean ** 2) * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def slime_rf_pp_returns(rewards, kl, masks, kl_coef, gamma):
    """Per sample: -kl_coef * kl * mask, the reward on the last masked token, discounted returns."""
    out = []
    for r, k, m in zip(rewards, kl, masks):
        token_rewards = -kl_coef * (k * m)
        last = m.nonzero(as_tuple=True)[0][-1]
        token_rewards[last] += r
        returns, acc = torch.zeros_like(token_rewards), 0.0
        for t in reversed(range(token_rewards.numel())):
            acc = token_rewards[t] + gamma * acc
            returns[t] = acc
        out.append(returns)
    return out


def sum_of_sample_mean(per_token, masks):
    return sum((x * m).sum() / m.sum().clamp(min=1) for x, m in zip(per_token, masks))


# --- helpers ------------------------------------------------------------------------------------
def samples(case):
    """slime's lists of per-sample response tensors (rows with a trained token only: slime asserts
    every sample has one)."""
    keep = [i for i, n in enumerate(case.lengths.tolist()) if n]
    return keep, [case.mask[i, :case.lengths[i]] for i in keep]


def ours(case, settings, kl=None):
    lengths, loss_mask = case.packed
    rows = BatchRows(lengths, loss_mask, torch.tensor(case.index), max(case.index) + 1)
    adv, _ = batch_advantages(settings, case.rewards, rows, kl=None if kl is None else case.from_peer(kl))
    return case.to_peer(adv) if adv.numel() != case.rewards.numel() else adv[:, None] * case.mask


# --- the comparisons ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("std,normalize", [(True, False), (False, False), (True, True)])
def test_grpo_gspo_advantages(seed, std, normalize):
    """--advantage-estimator grpo / gspo: group-normalised rewards on every token, optional
    --disable-grpo-std-normalization and --normalize-advantages (whitened over the DP group)."""
    case = make_case(seed)
    keep, masks = samples(case)
    r = slime_group_norm(case.rewards, case.group_size, std)
    adv = [torch.ones_like(m) * r[i] for i, m in zip(keep, masks)]
    if normalize:
        flat = slime_distributed_masked_whiten(torch.cat(adv), torch.cat(masks))
        adv = list(torch.split(flat, [m.numel() for m in masks]))
    settings = AdvantageSettings(advantage_estimator="grpo" if std else "dr_grpo",
                                 estimator_args={"group_std": "unbiased"} if std else {},
                                 whiten_advantages=normalize)
    got = ours(case, settings)
    for i, a in zip(keep, adv):
        torch.testing.assert_close(got[i, :case.lengths[i]], a, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.95])
@pytest.mark.parametrize("kl_coef,kl_type", [(0.0, "k1"), (0.2, "k1"), (0.2, "low_var_kl")])
def test_reinforce_plus_plus_with_kl_in_reward(seed, gamma, kl_coef, kl_type):
    """--advantage-estimator reinforce_plus_plus --kl-coef --normalize-advantages: the KL of pi_old
    from the reference in each token's reward, returns, whitened."""
    case = make_case(seed)
    keep, masks = samples(case)
    kl = slime_approx_kl(case.old_log_probs, case.ref_log_probs, kl_type)
    returns = slime_rf_pp_returns([case.rewards[i] for i in keep], [kl[i, :case.lengths[i]] for i in keep],
                                  masks, kl_coef, gamma)
    flat = slime_distributed_masked_whiten(torch.cat(returns), torch.cat(masks))
    want = list(torch.split(flat, [m.numel() for m in masks]))
    settings = AdvantageSettings(advantage_estimator="reinforce_plus_plus", estimator_args={"gamma": gamma},
                                 kl_in_reward_coef=kl_coef,
                                 kl_in_reward_estimator=kl_type)
    got = ours(case, settings, kl=token_kl(case.old_log_probs, case.ref_log_probs, kl_type) if kl_coef else None)
    for i, a in zip(keep, want):
        torch.testing.assert_close(got[i, :case.lengths[i]], a, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(seed):
    """reinforce_plus_plus_baseline with --kl-coef 0: the group mean subtracted (rollout
    post-processing, no std), on every token, whitened. (With a KL coefficient slime subtracts each
    token's own KL, not the sum: migrate names that.)"""
    case = make_case(seed)
    keep, masks = samples(case)
    r = slime_group_norm(case.rewards, case.group_size, std_normalization=False)
    adv = [torch.ones_like(m) * r[i] for i, m in zip(keep, masks)]
    flat = slime_distributed_masked_whiten(torch.cat(adv), torch.cat(masks))
    want = list(torch.split(flat, [m.numel() for m in masks]))
    got = ours(case, AdvantageSettings(advantage_estimator="reinforce_plus_plus_baseline"))
    for i, a in zip(keep, want):
        torch.testing.assert_close(got[i, :case.lengths[i]], a, **TOL)


def _loss_and_grad(fn, lp):
    x = lp.clone().requires_grad_(True)
    loss = fn(x)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps_clip_c", [None, 3.0])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("per_token_loss", [False, True])
def test_gspo_policy_loss_with_kl_loss(seed, eps_clip_c, kl_type, per_token_loss):
    """--advantage-estimator gspo: ppo_kl = the sequence mean of old - new (compute_gspo_kl, with
    its gradient), --eps-clip / --eps-clip-high / --eps-clip-c, --use-kl-loss with --kl-loss-type,
    reduced by the per-sample mean, or with --calculate-per-token-loss by the mean over the batch's
    tokens (each token carrying its sequence's ratio: gspo with token-mean)."""
    case = make_case(seed, ratio_scale=0.05)
    row = int(torch.nonzero((case.rewards < 0) & (case.lengths > 1))[0])
    case.log_probs[row, :case.lengths[row]] += 1.5  # s_i > 3 on a negative advantage
    keep, masks = samples(case)

    def slime(x):
        loss = 0.0
        for i, m in zip(keep, masks):
            n = int(case.lengths[i])
            ppo_kl = ((case.old_log_probs[i, :n] - x[i, :n]) * m).sum() / m.sum().clamp(min=1)
            pg = slime_policy_loss(ppo_kl.expand(n), case.rewards[i].expand(n), 3e-4, 4e-4, eps_clip_c)
            kl = slime_approx_kl(x[i, :n], case.ref_log_probs[i, :n], kl_type)
            loss = loss + ((pg + 0.01 * kl) * m).sum() / (1.0 if per_token_loss else m.sum())
        return loss / (sum(m.sum() for m in masks) if per_token_loss else len(keep))
    want = _loss_and_grad(slime, case.log_probs)
    got = _loss_and_grad(lambda x: gspo_loss(x, case.old_log_probs, case.rewards, case.mask.bool(),
                                             dual_clip_c=eps_clip_c, ref_log_probs=case.ref_log_probs,
                                             kl_coef=0.01, kl_estimator=kl_type,
                                             loss_agg_mode="token-mean" if per_token_loss else "seq-mean-token-mean"),
                         case.log_probs)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_loss", [False, True])
def test_token_ratio_loss(seed, per_token_loss):
    """--advantage-estimator grpo's token ratio, dual clip, the per-sample mean or, with
    --calculate-per-token-loss, the mean over the batch's tokens."""
    case = make_case(seed, ratio_scale=0.8)
    adv = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    keep, masks = samples(case)

    def slime(x):
        per = [slime_policy_loss(case.old_log_probs[i, :m.numel()] - x[i, :m.numel()], adv[i, :m.numel()],
                                 0.2, 0.28, 3.0) for i, m in zip(keep, masks)]
        if per_token_loss:
            return sum((p * m).sum() for p, m in zip(per, masks)) / sum(m.sum() for m in masks)
        return sum_of_sample_mean(per, masks) / len(keep)
    want = _loss_and_grad(slime, case.log_probs)
    got = _loss_and_grad(lambda x: grpo_loss(x, case.old_log_probs, adv, case.mask.bool(), eps_low=0.2, eps_high=0.28,
                                             dual_clip_c=3.0, loss_agg_mode="token-mean" if per_token_loss
                                             else "seq-mean-token-mean"), case.log_probs)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
