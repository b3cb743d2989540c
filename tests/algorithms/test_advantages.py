"""group_advantages: docs/algorithm.md property 9 and Eq. 6."""
import pytest
import torch

from gspo_megatron.algorithms import group_advantages


def test_group_advantages_sum_to_zero_per_group_and_match_eq6():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    adv = group_advantages(rewards, group_size=8)
    assert adv.shape == (24,) and adv.dtype == torch.float32
    groups = rewards.view(3, 8)
    expected = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, correction=0, keepdim=True) + 1e-6)
    torch.testing.assert_close(adv, expected.view(24))
    torch.testing.assert_close(adv.view(3, 8).sum(1), torch.zeros(3), atol=1e-5, rtol=0)


def test_equal_rewards_give_exactly_zero():
    # 0.1 is not exactly representable and its mean over 7 need not reproduce it bit for bit:
    # the zero must come from the equality check, not from a tiny std.
    rewards = torch.tensor([0.1] * 7 + [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=7)
    assert torch.equal(adv[:7], torch.zeros(7, dtype=torch.float64))
    assert torch.isfinite(adv).all() and adv[7:].abs().sum() > 0
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))


def test_integer_rewards_and_scale():
    adv = group_advantages(torch.tensor([0, 1, 1, 0]), 4)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5, rtol=0)


def test_errors_name_the_sizes():
    with pytest.raises(ValueError, match=r"10 rewards do not split into groups of 4"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match=r"1-D"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match=r"group_size must be >= 1, got 0"):
        group_advantages(torch.zeros(4), 0)
