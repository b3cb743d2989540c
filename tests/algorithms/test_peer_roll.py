"""Against ROLL's own formulas (roll/utils/functionals.py: reward_norm, RunningMoments,
reward_postprocess, compute_token_reward, compute_reinforce_return, masked_whiten,
compute_advantage, compute_approx_kl, agg_loss; roll/pipeline/rlvr/actor_worker.py loss_func with
importance_sampling and dual_clip_loss; alibaba/ROLL at 8eb27cc2), transcribed here independently
of the code under test. Values and gradients in fp64 within 1e-12 on random ragged batches with
empty rows and groups of equal rewards; ROLL's +1e-8 guards in masked means are left out (as in
test_peer_verl.py: they move values by 1e-8 / count of their size)."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms import grpo_loss, gspo_loss, gspo_token_loss
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages, shape_rewards
from gspo_megatron.algorithms.advantage.shaping import RunningMoments
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.algorithms.kl import token_kl
from gspo_megatron.algorithms.terms import Aggregation
from peer_cases import F64, make_case

TOL = dict(rtol=0, atol=1e-12)
SEEDS = [0, 1, 2]


# --- ROLL, transcribed -----------------------------------------------------------------------
class RollRunningMoments:
    def __init__(self):
        self.mean, self.std, self.var, self.count = 0, 1, 1, 1e-24

    def update(self, xs):
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs, unbiased=False)
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        new_sum = xs_var * xs_count
        old_sum = self.var * self.count + delta ** 2 * self.count * xs_count / tot_count
        self.mean += delta * xs_count / tot_count
        self.var = (old_sum + new_sum) / tot_count
        self.std = (self.var * tot_count / (tot_count - 1)).sqrt()
        self.count = tot_count


def roll_reward_norm(rewards, n_sample, running, norm_mean_type, norm_std_type):
    group_mode = "group" in (norm_mean_type, norm_std_type)
    reshaped = rewards.reshape(-1, n_sample) if group_mode else None
    if "running" in (norm_mean_type, norm_std_type):
        running.update(rewards)
    mean = {"batch": lambda: rewards.mean(), "group": lambda: reshaped.mean(dim=-1, keepdim=True),
            "running": lambda: running.mean, None: lambda: 0.0}[norm_mean_type]()
    std = {"batch": lambda: rewards.std(), "group": lambda: torch.std(reshaped, dim=-1, keepdim=True),
           "running": lambda: running.std, None: lambda: None}[norm_std_type]()
    base = reshaped if norm_mean_type == "group" else rewards
    out = (base - mean) / (std + 1e-6) if norm_std_type is not None else base - mean
    return out.reshape(rewards.shape) if norm_mean_type == "group" else out


def roll_approx_kl(log_probs, log_probs_base, action_mask, kl_penalty):
    if kl_penalty == "kl":
        log_ratio = log_probs - log_probs_base
    elif kl_penalty == "abs":
        log_ratio = (log_probs - log_probs_base).abs()
    elif kl_penalty == "mse":
        log_ratio = 0.5 * (log_probs - log_probs_base).square()
    else:  # "k3"
        kl = log_probs_base - log_probs
        log_ratio = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return log_ratio * action_mask


def roll_masked_mean(tensor, mask, dim=None):
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    n = mask.sum(dim)
    return torch.where(n > 0, (tensor * mask).sum(dim) / torch.where(n > 0, n, 1.0), torch.zeros_like(n))


def roll_masked_whiten(values, mask):
    mean = roll_masked_mean(values, mask)
    var = roll_masked_mean((values - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def roll_reinforce_return(token_level_rewards, gamma):
    out, cumulative = [], 0
    for t in reversed(range(token_level_rewards.shape[-1])):
        cumulative = token_level_rewards[:, t] + gamma * cumulative
        out.append(cumulative)
    return torch.stack(out[::-1], dim=1)


def roll_advantages(case, *, reward_clip=None, norm=(None, None), running=None, kl_coef=None,
                    kl_penalty="kl", gamma=1.0, whiten=False, advantage_clip=None):
    """reward_postprocess -> compute_token_reward -> compute_advantage, for adv_estimator reinforce
    (and ROLL's grpo, which is reinforce after the group norm)."""
    r = roll_reward_norm(case.rewards.clone(), case.group_size, running, *norm)
    if reward_clip:
        r = torch.clamp(r, min=-reward_clip, max=reward_clip)
    token_level_rewards = torch.zeros_like(case.mask)
    for i, n in enumerate(case.lengths.tolist()):
        if n:  # expand_to_token_level: the reward on the last real token
            token_level_rewards[i, n - 1] = r[i]
    if kl_coef:
        kld = roll_approx_kl(case.old_log_probs, case.ref_log_probs, case.mask, kl_penalty)
        token_level_rewards = token_level_rewards - kl_coef * kld
    if reward_clip:
        token_level_rewards = torch.clamp(token_level_rewards, min=-reward_clip, max=reward_clip)
    token_level_rewards = token_level_rewards * case.mask
    advantages = roll_reinforce_return(token_level_rewards, gamma)
    if whiten:
        advantages = roll_masked_whiten(advantages, case.mask)
    advantages = advantages * case.mask
    if advantage_clip is not None:
        advantages = torch.clamp(advantages, min=-advantage_clip, max=advantage_clip)
    return advantages


def roll_agg_loss(loss_mat, loss_mask, mode, global_valid_samples):
    if mode == "token-mean":  # ROLL sums loss_mat unmasked: its terms are 0 where the advantages are
        return loss_mat.sum() / loss_mask.sum()
    valid = torch.any(loss_mask > 0, dim=-1).to(loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        return (roll_masked_mean(loss_mat, loss_mask, dim=-1) * valid).sum() / global_valid_samples
    seq = (loss_mat * loss_mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return (seq * valid).sum() / global_valid_samples
    return (seq * valid).sum() / loss_mask.shape[-1]  # seq-mean-token-sum-norm


def roll_actor_loss(lp, case, advantages, importance_sampling, pg_clip, dual_clip_loss, mode,
                    kl_loss_coef=0.0, pg_clip_range=None):
    """actor_worker.loss_func with use_kl_loss; pg_clip both ways, or use_pg_clip_range with
    pg_clip_range = (pg_clip_low, pg_clip_high) (the dual clip's c stays 1 + 2 pg_clip)."""
    mask = case.mask
    valid = float(torch.any(mask > 0, dim=-1).sum())  # the pipeline's global_valid_samples
    if importance_sampling == "token":
        ratio = (lp - case.old_log_probs).exp()
    else:
        ratio = roll_masked_mean(lp - case.old_log_probs, mask, dim=-1).exp().unsqueeze(-1).expand_as(lp)
    low, high = pg_clip_range or (pg_clip, pg_clip)
    surr1, surr2 = ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip_loss:
        loss = torch.where(advantages < 0, -torch.max(-loss, (1 + pg_clip * 2) * advantages), loss)
    total = roll_agg_loss(loss, mask, mode, valid)
    if kl_loss_coef:
        kl = roll_approx_kl(lp, case.ref_log_probs, mask, "k3")
        total = total + roll_agg_loss(kl, mask, mode, valid) * kl_loss_coef
    return total


# --- the comparisons ----------------------------------------------------------------------------
def ours(case, settings, running=None, kl=None):
    lengths, loss_mask = case.packed
    rows = BatchRows(lengths, loss_mask, torch.tensor(case.index), max(case.index) + 1)
    shaped, _ = shape_rewards(settings, case.rewards, case.group_size, running)
    adv, _ = batch_advantages(settings, shaped, rows, kl=None if kl is None else case.from_peer(kl))
    return case.to_peer(adv) if adv.numel() != case.rewards.numel() else adv[:, None] * case.mask


@pytest.mark.parametrize("norm", [("group", "group"), ("batch", "batch"), ("group", None), (None, "batch"),
                                  ("batch", None), (None, None)])
@pytest.mark.parametrize("seed", SEEDS)
def test_reward_norm_and_clip(norm, seed):
    case = make_case(seed)
    want = roll_advantages(case, reward_clip=0.8, norm=norm)
    settings = AdvantageSettings(advantage_estimator="reinforce", reward_norm_mean=norm[0],
                                 reward_norm_std=norm[1], reward_clip=0.8)
    torch.testing.assert_close(ours(case, settings), want, **TOL)


def test_running_reward_norm_over_steps():
    """ROLL's RunningMoments: the statistics of every reward so far, this batch's included."""
    theirs, mine = RollRunningMoments(), RunningMoments()
    settings = AdvantageSettings(advantage_estimator="reinforce", reward_norm_mean="running",
                                 reward_norm_std="running")
    for step in range(3):
        case = make_case(10 + step)
        want = roll_advantages(case, norm=("running", "running"), running=theirs)
        torch.testing.assert_close(ours(case, settings, running=mine), want, **TOL)
        mine = RunningMoments.from_state(mine.to_state())  # as a resume restores it
    assert mine.count == pytest.approx(48.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("kl", [None, "kl", "k3"])
def test_reinforce_whitened_clipped_with_token_level_kl(seed, gamma, kl):
    """The seed's configuration (adv_estimator reinforce, whiten_advantages, advantage_clip 2,
    reward_clip 10) and add_token_level_kl with ROLL's kl_penalty kinds."""
    case = make_case(seed)
    kw = dict(kl_coef=0.5, kl_penalty=kl) if kl else {}
    want = roll_advantages(case, reward_clip=10.0, gamma=gamma, whiten=True, advantage_clip=2.0, **kw)
    settings = AdvantageSettings(advantage_estimator="reinforce", whiten_advantages=True, advantage_clip=2.0,
                                 reward_clip=10.0, estimator_args={"gamma": gamma}, kl_in_reward_coef=0.5 if kl else 0.0,
                                 kl_in_reward_estimator={"kl": "k1", "k3": "low_var_kl", None: "k1"}[kl])
    ours_kl = token_kl(case.old_log_probs, case.ref_log_probs, settings.kl_in_reward_estimator) if kl else None
    torch.testing.assert_close(ours(case, settings, kl=ours_kl), want, **TOL)
    assert float(want.abs().max()) <= 2.0


@pytest.mark.parametrize("seed", SEEDS)
def test_roll_grpo_is_reinforce_after_the_group_norm(seed):
    """ROLL's adv_estimator grpo forces norm_mean_type = norm_std_type = group, then returns:
    with gamma 1 and no token KL that is our grpo with the unbiased std."""
    case = make_case(seed)
    want = roll_advantages(case, norm=("group", "group"))
    got = ours(case, AdvantageSettings(advantage_estimator="grpo", estimator_args={"group_std": "unbiased"}))
    torch.testing.assert_close(got, want, **TOL)


def _loss_and_grad(fn, lp):
    x = lp.clone().requires_grad_(True)
    loss = fn(x)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kl_loss_coef", [0.0, 0.001])
def test_seq_importance_sampling_dual_clip_is_gspo(seed, kl_loss_coef):
    """importance_sampling: seq with seq-mean-token-mean and dual_clip_loss (c = 1 + 2 pg_clip),
    use_kl_loss with ROLL's k3 (clamped: our low_var_kl) = gspo with dual_clip_c and the KL term."""
    case = make_case(seed, ratio_scale=0.3)
    row = int(torch.nonzero((case.rewards < 0) & (case.lengths > 1))[0])
    case.log_probs[row, :case.lengths[row]] = case.old_log_probs[row, :case.lengths[row]] + 0.5  # s > 1.4
    adv = case.rewards[:, None].expand_as(case.mask)
    want = _loss_and_grad(lambda x: roll_actor_loss(x, case, adv, "seq", 0.2, True, "seq-mean-token-mean",
                                                    kl_loss_coef), case.log_probs)
    got = _loss_and_grad(lambda x: gspo_loss(x, case.old_log_probs, case.rewards, case.mask.bool(), eps_low=0.2,
                                             eps_high=0.2, dual_clip_c=1.4, ref_log_probs=case.ref_log_probs,
                                             kl_coef=kl_loss_coef, kl_estimator="low_var_kl"), case.log_probs)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert float(got[1][row].abs().max()) == 0.0 or kl_loss_coef  # the dual clip held that row


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_token_importance_sampling_every_aggregation(seed, mode):
    """importance_sampling: token = grpo, per-token advantages, dual clip, every loss_agg_mode;
    ROLL's seq-mean-token-sum-norm divides the token sums by the padded width without a mean over
    sequences (ours: Dr. GRPO's (1/N) sum_i sum_t / C, C = the width here)."""
    case = make_case(seed, ratio_scale=0.5)  # 0 at padding, as ROLL's compute_advantage leaves them
    adv = torch.randn(case.mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * case.mask
    want = _loss_and_grad(lambda x: roll_actor_loss(x, case, adv, "token", 0.2, True, mode, 0.01), case.log_probs)
    width = float(case.mask.shape[-1])
    kw = dict(token_sum_norm=width) if mode == "seq-mean-token-sum-norm" else {}
    got = _loss_and_grad(lambda x: grpo_loss(x, case.old_log_probs, adv, case.mask.bool(), eps_low=0.2, eps_high=0.2,
                                             dual_clip_c=1.4, loss_agg_mode=Aggregation.of(mode, kw),
                                             ref_log_probs=case.ref_log_probs, kl_coef=0.01, kl_estimator="low_var_kl"),
                          case.log_probs)
    if mode == "seq-mean-token-sum-norm":
        n = float((case.lengths > 0).sum())
        want = (want[0] / n, want[1] / n)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


MODES = ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"]


def _seq_case(seed):
    """Ragged rows, two empty ones, ratios on both sides of GSPO's clip (3e-4 / 4e-4), one row with
    a negative advantage past the dual clip's c = 1.4; advantages one per row, or per token (ROLL
    gives every token one: its reinforce returns with gamma < 1 or the token KL), 0 at padding as
    ROLL's compute_advantage leaves them."""
    case = make_case(seed, ratio_scale=0.002)
    neg = int(torch.nonzero((case.rewards < 0) & (case.lengths > 1))[0])
    case.log_probs[neg, :case.lengths[neg]] = case.old_log_probs[neg, :case.lengths[neg]] + 0.5
    g = torch.Generator().manual_seed(100 + seed)
    token_adv = torch.randn(case.mask.shape, generator=g, dtype=F64) * case.mask
    return case, neg, token_adv


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("advantages", ["row", "token"])
def test_seq_importance_sampling_every_aggregation_is_gspo(seed, mode, advantages):
    """importance_sampling: seq (the sequence ratio broadcast to the row's tokens, each token's
    clipped term, agg_loss of every loss_agg_mode), dual_clip_loss and use_kl_loss (k3 clamped:
    our low_var_kl), with GSPO's clip through use_pg_clip_range = gspo with the same loss_agg_mode:
    values and gradients. ROLL's seq-mean-token-sum-norm sums the rows without a mean over them
    (docs/algorithm.md: ours is Dr. GRPO's (1/N), ROLL's N times it)."""
    case, neg, token_adv = _seq_case(seed)
    row_adv = case.rewards
    adv = row_adv[:, None] * case.mask if advantages == "row" else token_adv
    width = float(case.mask.shape[-1])
    want = _loss_and_grad(lambda x: roll_actor_loss(x, case, adv, "seq", 0.2, True, mode, 0.001,
                                                    pg_clip_range=(3e-4, 4e-4)), case.log_probs)
    kw = dict(token_sum_norm=width) if mode == "seq-mean-token-sum-norm" else {}
    got = _loss_and_grad(lambda x: gspo_loss(x, case.old_log_probs, row_adv if advantages == "row" else adv,
                                             case.mask.bool(), dual_clip_c=1.4, loss_agg_mode=Aggregation.of(mode, kw),
                                             ref_log_probs=case.ref_log_probs, kl_coef=0.001,
                                             kl_estimator="low_var_kl"), case.log_probs)
    if mode == "seq-mean-token-sum-norm":
        n = float((case.lengths > 0).sum())
        want = (want[0] / n, want[1] / n)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    # the clips bite: some rows clipped (no policy gradient), others not; the dual clip holds a row
    s = torch.exp(roll_masked_mean(case.log_probs - case.old_log_probs, case.mask, dim=-1))
    clipped = ((row_adv > 0) & (s > 1 + 4e-4)) | ((row_adv < 0) & (s < 1 - 3e-4))
    live = case.lengths > 0
    assert 0 < int((clipped & live).sum()) < int(live.sum()) and float(s[neg]) > 1.4


@pytest.mark.parametrize("mode", MODES)
def test_gspo_token_is_roll_seq_with_one_advantage_per_row_and_the_paper_with_per_token_ones(mode):
    """gspo_token (Eqs. 13-14) = ROLL's importance_sampling: seq when the advantages are constant
    along a row, every aggregation; with per-token advantages the values agree but the gradients
    do not: ROLL differentiates through s_i (each token gets s_i / L_i times the row's active
    advantages), GSPO-token through its token factor (token t gets s_i A_t): migrate maps ROLL's
    seq to gspo, which computes ROLL's gradient (the test above)."""
    case, _, token_adv = _seq_case(0)
    width = float(case.mask.shape[-1])
    kw = dict(token_sum_norm=width) if mode == "seq-mean-token-sum-norm" else {}
    n = float((case.lengths > 0).sum()) if mode == "seq-mean-token-sum-norm" else 1.0
    for adv, same_gradient in ((case.rewards[:, None] * case.mask, True), (token_adv, False)):
        want = _loss_and_grad(lambda x: roll_actor_loss(x, case, adv, "seq", 0.2, False, mode,
                                                        pg_clip_range=(3e-4, 4e-4)), case.log_probs)
        got = _loss_and_grad(lambda x: gspo_token_loss(x, case.old_log_probs, adv, case.mask.bool(),
                                                       loss_agg_mode=Aggregation.of(mode, kw)), case.log_probs)
        torch.testing.assert_close(got[0], want[0] / n, **TOL)
        assert torch.allclose(got[1], want[1] / n, rtol=0, atol=1e-12) == same_gradient
