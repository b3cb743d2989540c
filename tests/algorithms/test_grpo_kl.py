"""GRPO baseline (Eqs. 2-3) and the optional KL penalty (k1, k3)."""
import math

import pytest
import torch

from gspo_megatron.algorithms import grpo_loss, gspo_loss, gspo_token_loss, kl_penalty, token_kl
from gspo_megatron.algorithms.terms import KL_ESTIMATORS
from test_gspo import F64, batch, loss_and_grad


def test_grpo_token_gradients_and_per_token_clipping():
    old = torch.zeros(2, 3, dtype=F64)
    lp = torch.tensor([[0.5, 0.0, -0.5], [0.1, 0.3, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, grad, m = loss_and_grad(grpo_loss, lp, old, adv, mask)
    w = torch.exp(lp)
    # row 0 (A>0): token 0 has w = 1.65 > 1.27 -> clipped; the others active: -w A / (G L)
    # row 1 (A<0): nothing below 0.8 -> both active; the pad gets 0
    expected = torch.tensor([[0.0, -w[0, 1] / 6, -w[0, 2] / 6], [w[1, 0] / 4, w[1, 1] / 4, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected)
    row0 = -(1.27 + w[0, 1] + w[0, 2]) / 3
    row1 = (w[1, 0] + w[1, 1]) / 2
    torch.testing.assert_close(loss, (row0 + row1) / 2)
    assert m["clipped_tokens"].item() == 1 and m["clip_fraction"].item() == pytest.approx(1 / 5)


def test_grpo_equals_gspo_on_single_token_rows():
    lp, old, adv, _ = batch(scale=0.3, s=1)
    mask = torch.ones_like(lp, dtype=torch.bool)
    la, ga, ma = loss_and_grad(grpo_loss, lp, old, adv, mask, eps_low=3e-4, eps_high=4e-4)
    lb, gb, mb = loss_and_grad(gspo_loss, lp, old, adv, mask)
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(ga, gb)
    assert ma["clipped_tokens"] == mb["clipped_tokens"]


def test_grpo_defaults_and_token_advantages():
    import inspect
    p = inspect.signature(grpo_loss).parameters
    assert (p["eps_low"].default, p["eps_high"].default) == (0.2, 0.27)
    lp, old, adv, mask = batch(scale=0.1)
    a = loss_and_grad(grpo_loss, lp, old, adv, mask)
    b = loss_and_grad(grpo_loss, lp, old, adv[:, None].expand_as(lp), mask)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradcheck_grpo(reduction):
    lp, old, adv, mask = batch(scale=0.3, seed=11)
    torch.autograd.gradcheck(lambda x: grpo_loss(x, old, adv, mask, reduction=reduction)[0],
                             (lp.clone().requires_grad_(True),))


def test_grpo_masked_positions_and_empty_rows():
    lp, old, adv, mask = batch(scale=0.1)
    ref = loss_and_grad(grpo_loss, lp, old, adv, mask)
    got = loss_and_grad(grpo_loss, torch.where(mask, lp, float("nan")), torch.where(mask, old, float("inf")),
                        adv, mask)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert torch.equal(got[1][~mask], torch.zeros_like(got[1][~mask]))


# KL ----------------------------------------------------------------------------------------------
def test_kl_estimators_values():
    lp = torch.tensor([[-1.0, -2.0, -0.5, 7.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    d = torch.tensor([0.5, -1.0, 0.0], dtype=F64)  # log pi - log pi_ref on the trainable tokens
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k1"), d.mean()[None])
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k3"), (torch.exp(-d) + d - 1).mean()[None])
    assert kl_penalty(lp, lp, mask, "k3").item() == 0.0
    assert (token_kl(lp[:, :3], ref[:, :3], "k3") >= 0).all()
    assert kl_penalty(lp, ref, torch.zeros_like(mask), "k3").item() == 0.0
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k2"), (d.square() / 2).mean()[None])
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "abs"), d.abs().mean()[None])
    with pytest.raises(ValueError, match="kl_estimator='full': expected one of k1, k2, k3, low_var_kl, abs"):  # verl's full-distribution KL: not offered
        kl_penalty(lp, ref, mask, "full")


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_kl_gradcheck_and_zero_grad_on_masked(estimator):
    lp, old, adv, mask = batch(scale=0.2)
    ref = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, mask, estimator),
                             (lp.clone().requires_grad_(True),))
    x = lp.clone().requires_grad_(True)
    kl_penalty(x, ref, mask, estimator).sum().backward()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss, grpo_loss])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_term_added_per_row(fn, estimator):
    lp, old, adv, mask = batch(scale=1e-4)
    if fn is gspo_token_loss:
        adv = adv[:, None].expand_as(lp)
    ref = old - 0.05
    coef = 0.3
    base, gbase, mbase = loss_and_grad(fn, lp, old, adv, mask)
    loss, grad, m = loss_and_grad(fn, lp, old, adv, mask, ref_log_probs=ref, kl_coef=coef, kl_estimator=estimator)
    valid = mask.any(-1)
    kl = kl_penalty(lp, ref, mask, estimator)
    torch.testing.assert_close(loss, base + coef * kl[valid].mean())
    x = lp.clone().requires_grad_(True)
    (kl_grad,) = torch.autograd.grad(kl_penalty(x, ref, mask, estimator)[valid].mean(), x)
    torch.testing.assert_close(grad, gbase + coef * kl_grad)
    torch.testing.assert_close(m["kl"], kl[valid].mean())
    assert "kl" not in mbase
    # Reported with kl_coef = 0 too, without changing the loss.
    loss0, _, m0 = loss_and_grad(fn, lp, old, adv, mask, ref_log_probs=ref, kl_estimator=estimator)
    torch.testing.assert_close(loss0, base)
    torch.testing.assert_close(m0["kl"], m["kl"])
    assert math.isfinite(m["kl_sum"].item())
