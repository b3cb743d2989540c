"""GSPO and GSPO-token losses: docs/algorithm.md properties 1-8, 10 and 12, by autograd against hand-derived
gradients and by finite differences (gradcheck, fp64)."""
import math

import pytest
import torch

from gspo_megatron.algorithms import LOG_RATIO_CLAMP, gspo_loss, gspo_token_loss

F64 = torch.float64


def loss_and_grad(fn, log_probs, *args, **kwargs):
    lp = log_probs.detach().clone().requires_grad_(True)
    loss, metrics = fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def batch(seed=0, b=5, s=9, scale=1e-4, dtype=F64):
    """Rows of uneven length (last row fully masked), small off-policy log-ratios."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=dtype) * 3
    lp = old + scale * torch.randn(b, s, generator=g, dtype=dtype)
    lengths = torch.tensor([s, 1, 4, s - 2, 0][:b])
    mask = torch.arange(s)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=dtype)
    return lp, old, adv, mask


def masked_mean_log_ratio(lp, old, mask):
    return ((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)


# 12. Worked example ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_worked_example(dtype):
    old = torch.zeros(1, 4, dtype=dtype)
    lp = torch.tensor([[0.1, -0.2, 0.4, 123.0]], dtype=dtype)  # last = pad, any value
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, grad, m = loss_and_grad(gspo_loss, lp, old, torch.tensor([1.0]), mask, eps_low=3e-4, eps_high=4e-4)
    assert m["seq_ratio_mean"].item() == pytest.approx(1.10517, abs=1e-5)
    assert loss.item() == pytest.approx(-1.0004, abs=1e-6)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m["clip_fraction"].item() == 1.0
    loss, grad, m = loss_and_grad(gspo_loss, lp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(1.10517, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.368390, 0.368390, 0.368390, 0.0]], dtype=dtype),
                               atol=1e-6, rtol=0)
    assert grad[0, 3].item() == 0.0
    assert m["clip_fraction"].item() == 0.0


# 1. s_i is the geometric mean of the token ratios --------------------------------------------------
def test_seq_ratio_is_geometric_mean_of_token_ratios():
    lp, old, adv, mask = batch(scale=0.3)
    _, m = gspo_loss(lp, old, adv, mask)
    for i in range(lp.shape[0]):
        r = torch.exp(lp[i] - old[i])[mask[i]]
        if r.numel():
            geo = torch.prod(r) ** (1.0 / r.numel())
            per_row = gspo_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1])[1]["seq_ratio_mean"]
            torch.testing.assert_close(per_row, geo)
    valid = mask.any(-1)
    expected = torch.exp(masked_mean_log_ratio(lp, old, mask))[valid]
    torch.testing.assert_close(m["seq_ratio_min"], expected.min())
    torch.testing.assert_close(m["seq_ratio_max"], expected.max())
    torch.testing.assert_close(m["seq_ratio_mean"], expected.mean())


@pytest.mark.parametrize("length", [1, 7, 1000])
def test_constant_log_ratio_gives_e_to_the_d_at_any_length(length):
    d = 0.0173
    old = torch.zeros(1, length)
    _, m = gspo_loss(old + d, old, torch.tensor([1.0]), torch.ones(1, length, dtype=torch.bool))
    assert m["seq_ratio_mean"].item() == pytest.approx(math.exp(d), rel=1e-6)


# 2. On-policy ------------------------------------------------------------------------------------
def test_on_policy_ratio_one_loss_minus_mean_advantage_and_gradient():
    _, old, adv, mask = batch()
    loss, grad, m = loss_and_grad(gspo_loss, old, old, adv, mask)
    valid = mask.any(-1)
    G = valid.sum()
    L = mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(loss, -adv[valid].mean())
    assert m["seq_ratio_min"].item() == m["seq_ratio_max"].item() == 1.0
    expected = torch.where(mask, (-adv / (G * L))[:, None], 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


# 3. Off-policy, unclipped: constant gradient along the row ---------------------------------------
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.9, 5.0)])
def test_off_policy_unclipped_gradient(eps):
    scale = 1e-5 if eps[0] < 1e-3 else 0.3  # inside the clip range in both cases
    lp, old, adv, mask = batch(scale=scale)
    loss, grad, m = loss_and_grad(gspo_loss, lp, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    assert m["clip_fraction"].item() == 0.0
    valid = mask.any(-1)
    s = torch.exp(masked_mean_log_ratio(lp, old, mask))
    G, L = valid.sum(), mask.sum(-1).clamp(min=1)
    expected = torch.where(mask, (-s * adv / (G * L))[:, None], 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(loss, -(s * adv)[valid].mean())


# 4. / 5. Clipping is per sequence, all or nothing -------------------------------------------------
def test_clipping_per_sequence_four_cases():
    eps_low, eps_high = 3e-4, 4e-4
    L = 6
    old = torch.zeros(4, L, dtype=F64)
    # mean log-ratios: above 1+eps_high (rows 0,1), below 1-eps_low (rows 2,3); the tokens vary a lot
    # around the mean, so a per-token rule would clip some tokens of every row.
    wiggle = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.1, -0.1], dtype=F64)
    lp = torch.stack([wiggle + 2e-3, wiggle + 2e-3, wiggle - 2e-3, wiggle - 2e-3])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    mask = torch.ones(4, L, dtype=torch.bool)
    loss, grad, m = loss_and_grad(gspo_loss, lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    s = torch.exp(lp.mean(-1))
    # A>0 & s>1+eps_high (row 0) and A<0 & s<1-eps_low (row 2): whole row exactly zero.
    assert torch.equal(grad[0], torch.zeros(L, dtype=F64)) and torch.equal(grad[2], torch.zeros(L, dtype=F64))
    # The other two stay active with the GSPO gradient.
    for i in (1, 3):
        torch.testing.assert_close(grad[i], (-s[i] * adv[i] / (4 * L)).expand(L))
    expected_loss = -(1 + eps_high) * 1.0 - s[1] * -1.0 - (1 - eps_low) * -1.0 - s[3] * 1.0
    torch.testing.assert_close(loss, expected_loss / 4)
    assert m["clipped_sequences"].item() == 2 and m["clip_fraction"].item() == 0.5
    assert m["clipped_tokens"].item() == 2 * L and m["token_clip_fraction"].item() == 0.5


def test_clip_fraction_counts_whole_sequences():
    lp, old, adv, mask = batch(scale=0.2, seed=3)
    _, m = gspo_loss(lp, old, adv, mask)
    s = torch.exp(masked_mean_log_ratio(lp, old, mask))
    valid = mask.any(-1)
    clipped = valid & (((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4)))
    assert m["clipped_sequences"].item() == clipped.sum().item()
    assert m["clipped_tokens"].item() == mask.sum(-1)[clipped].sum().item()
    assert m["clip_fraction"].item() == pytest.approx(clipped.sum().item() / valid.sum().item())


# 6. Masked positions -----------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_masked_positions_change_nothing_and_get_zero_gradient(fn):
    lp, old, adv, mask = batch(scale=1e-4)
    if fn is gspo_token_loss:
        adv = adv[:, None] * torch.linspace(0.5, 1.5, lp.shape[1], dtype=F64)
    ref_loss, ref_grad, ref_m = loss_and_grad(fn, lp, old, adv, mask)
    for fill in (float("nan"), float("inf"), -float("inf"), 1e30, -7.0):
        lp2 = torch.where(mask, lp, fill)
        old2 = torch.where(mask, old, -fill)
        adv2 = torch.where(mask, adv, fill) if adv.dim() == 2 else adv
        loss, grad, m = loss_and_grad(fn, lp2, old2, adv2, mask)
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
        assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
        for k in ref_m:
            assert torch.equal(m[k], ref_m[k]), k


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_empty_rows_are_excluded_never_nan(fn):
    lp, old, adv, mask = batch()
    assert not mask[-1].any()
    if fn is gspo_token_loss:
        adv = adv[:, None].expand_as(lp)
    full, gfull, m = loss_and_grad(fn, lp, old, adv, mask)
    part, gpart, _ = loss_and_grad(fn, lp[:-1], old[:-1], adv[:-1], mask[:-1])
    torch.testing.assert_close(full, part)
    torch.testing.assert_close(gfull[:-1], gpart)
    assert m["num_sequences"].item() == lp.shape[0] - 1
    # A batch with no trainable token at all: loss 0, gradient 0, metrics finite where defined.
    none = torch.zeros_like(mask)
    loss, grad, m = loss_and_grad(fn, lp, old, adv, none)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert m["num_sequences"].item() == 0 and m["clip_fraction"].item() == 0.0
    assert m["seq_ratio_min"].item() == math.inf and m["seq_ratio_max"].item() == -math.inf


# 7. Invariances ----------------------------------------------------------------------------------
def test_permuting_tokens_within_a_row_keeps_the_ratio():
    lp, old, adv, mask = batch(scale=0.1)
    mask = torch.ones_like(mask)
    perm = torch.randperm(lp.shape[1], generator=torch.Generator().manual_seed(1))
    a = gspo_loss(lp, old, adv, mask)
    b = gspo_loss(lp[:, perm], old[:, perm], adv, mask)
    torch.testing.assert_close(a[0], b[0])
    for k in ("seq_ratio_min", "seq_ratio_max", "seq_ratio_mean", "clip_fraction"):
        torch.testing.assert_close(a[1][k], b[1][k])


def test_permuting_rows_keeps_the_loss():
    lp, old, adv, mask = batch(scale=3e-4)
    perm = torch.tensor([3, 0, 4, 2, 1])
    la, ga, _ = loss_and_grad(gspo_loss, lp, old, adv, mask)
    lb, gb, _ = loss_and_grad(gspo_loss, lp[perm], old[perm], adv[perm], mask[perm])
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(ga[perm], gb)


def test_scaling_advantages_scales_loss_and_gradient():
    lp, old, adv, mask = batch(scale=3e-4, seed=5)
    lp[0] += 1e-3  # rows 0 and 1: pushed out of the clip range, so a mix of clipped and active rows
    lp[1] -= 1e-3
    adv[0], adv[1] = 0.7, -1.3
    la, ga, ma = loss_and_grad(gspo_loss, lp, old, adv, mask)
    assert 0 < ma["clipped_sequences"].item() < ma["num_sequences"].item()
    c = 2.5
    lb, gb, _ = loss_and_grad(gspo_loss, lp, old, c * adv, mask)
    torch.testing.assert_close(lb, c * la)
    torch.testing.assert_close(gb, c * ga)


# 8. GSPO-token ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e-5, 3e-4, 0.3])
def test_gspo_token_equals_gspo_with_constant_advantages(scale):
    lp, old, adv, mask = batch(scale=scale, seed=2)
    la, ga, ma = loss_and_grad(gspo_loss, lp, old, adv, mask)
    lb, gb, mb = loss_and_grad(gspo_token_loss, lp, old, adv[:, None].expand_as(lp), mask)
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(ga, gb)
    for k in ("token_clip_fraction", "clipped_tokens", "seq_ratio_mean", "num_sequences"):
        torch.testing.assert_close(ma[k], mb[k])


def test_gspo_token_gradient_with_per_token_advantages():
    lp, old, _, mask = batch(scale=1e-5, seed=4)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    loss, grad, m = loss_and_grad(gspo_token_loss, lp, old, adv, mask)
    assert m["clip_fraction"].item() == 0.0
    valid = mask.any(-1)
    s = torch.exp(masked_mean_log_ratio(lp, old, mask))
    G, L = valid.sum(), mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(grad, torch.where(mask, -s[:, None] * adv / (G * L[:, None]), 0.0))
    torch.testing.assert_close(loss, (torch.where(mask, -s[:, None] * adv, 0).sum(-1) / L)[valid].mean())


def test_gspo_token_clips_per_token_by_sign_of_advantage():
    old = torch.zeros(1, 4, dtype=F64)
    lp = torch.full((1, 4), 1e-3, dtype=F64)  # s = e^1e-3 > 1 + eps_high
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0]], dtype=F64)
    loss, grad, m = loss_and_grad(gspo_token_loss, lp, old, adv, torch.ones(1, 4, dtype=torch.bool))
    s = math.exp(1e-3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, s / 4, 0.0, 2 * s / 4]], dtype=F64))
    assert m["clip_fraction"].item() == 0.5 and m["clipped_tokens"].item() == 2


# 10. No overflow ---------------------------------------------------------------------------------
def test_long_sequence_no_overflow():
    n = 32768
    old = torch.full((1, n), -2.0)
    lp = old + 0.01  # the sum of log-ratios is 327.68: exp of it would overflow fp32
    loss, grad, m = loss_and_grad(gspo_loss, lp, old, torch.tensor([-1.0]), torch.ones(1, n, dtype=torch.bool))
    assert m["seq_ratio_mean"].item() == pytest.approx(math.exp(0.01), rel=1e-6)
    assert torch.isfinite(grad).all() and loss.item() == pytest.approx(math.exp(0.01), rel=1e-6)
    torch.testing.assert_close(grad, torch.full_like(grad, math.exp(0.01) / n))


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_extreme_log_ratio_is_clamped_finite(fn):
    old = torch.zeros(2, 3)
    lp = torch.tensor([[100.0, 90.0, 80.0], [-100.0, -90.0, -80.0]])
    adv = torch.tensor([-1.0, 1.0])
    if fn is gspo_token_loss:
        adv = adv[:, None].expand_as(lp)
    loss, grad, m = loss_and_grad(fn, lp, old, adv, torch.ones(2, 3, dtype=torch.bool))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert m["seq_ratio_max"].item() == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
    assert m["seq_ratio_min"].item() == pytest.approx(math.exp(-LOG_RATIO_CLAMP), rel=1e-5)


# Finite differences ------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradcheck_gspo(reduction):
    for scale in (1e-5, 0.3):  # mostly active rows; a mix of clipped rows (kinks far from the point)
        lp, old, adv, mask = batch(scale=scale, seed=7)
        torch.autograd.gradcheck(lambda x: gspo_loss(x, old, adv, mask, reduction=reduction)[0],
                                 (lp.clone().requires_grad_(True),))
        # GSPO-token's gradient is the gradient of its value only for A constant along a row: with
        # per-token A the stop-gradients of Eq. 13 make them differ by design (tested above).
        tok_adv = adv[:, None].expand_as(lp)
        torch.autograd.gradcheck(lambda x: gspo_token_loss(x, old, tok_adv, mask, reduction=reduction)[0],
                                 (lp.clone().requires_grad_(True),))


# Bad input -----------------------------------------------------------------------------------------
def test_bad_input_errors_name_the_values():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=r"advantages have shape \(5, 8\), expected \(5,\) or \(5, 9\)"):
        gspo_loss(lp, old, adv[:, None].expand(5, 8), mask)
    with pytest.raises(ValueError, match=r"advantages have shape \(5,\), expected \(5, 9\)"):
        gspo_token_loss(lp, old, adv, mask)
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(5, 8\)"):
        gspo_loss(lp, old[:, :8], adv, mask)
    with pytest.raises(ValueError, match="reduction must be one of .* got 'avg'"):
        gspo_loss(lp, old, adv, mask, reduction="avg")
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_log_probs"):
        gspo_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="eps_low=1.5"):
        gspo_loss(lp, old, adv, mask, eps_low=1.5)


def test_defaults_are_the_papers():
    import inspect
    for fn in (gspo_loss, gspo_token_loss):
        p = inspect.signature(fn).parameters
        assert (p["eps_low"].default, p["eps_high"].default) == (3e-4, 4e-4)
        assert p["kl_coef"].default == 0.0 and p["reduction"].default == "mean"
