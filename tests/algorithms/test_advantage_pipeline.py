"""The advantage pipeline's own properties (the peers' formulas: test_peer_*.py): grpo is GSPO
Eq. 6 with exact zeros for equal rewards, group advantages sum to zero per group, a row's advantage
is its tokens' (whitening weighs rows by their trained tokens), per-turn credit for both kinds of
estimator, the KL in the reward left to the last stage by the driver, and the decision of one
advantage per row or per token."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import ESTIMATORS, AdvantageSettings
from gspo_megatron.driver.samples_to_batch import samples_to_batch
from gspo_megatron.driver.turn_credit import turn_credit_advantages
from rollout.generation.sample import Sample

F64 = torch.float64


def rows(lengths, trained, group_size):
    mask = torch.cat([torch.arange(n) >= n - k for n, k in zip(lengths, trained)])
    n = len(lengths)
    return BatchRows(torch.tensor(lengths), mask, torch.arange(n) // group_size, n // group_size)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_sum_to_zero_per_group(name):
    r = rows([5, 6, 4, 7, 3, 8, 5, 5], [3, 4, 2, 5, 1, 6, 3, 2], 4)
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=F64)
    adv, _ = batch_advantages(AdvantageSettings(advantage_estimator=name), rewards, r)
    torch.testing.assert_close(adv.view(2, 4).sum(1), torch.zeros(2, dtype=F64), rtol=0, atol=1e-12)


def test_grpo_is_eq6_and_a_group_of_equal_rewards_gets_exactly_zero():
    """docs/algorithm.md property 9: A_i = (r_i - mean) / (std + 1e-6), the std of the set (no
    Bessel correction, so a group of one is defined), and exactly 0 for a group of equal rewards:
    by equality, not by a tiny std (0.1's mean over 7 need not give back 0.1 bit for bit)."""
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(0))
    adv, _ = batch_advantages(AdvantageSettings(), rewards, rows([4] * 24, [2] * 24, 8))
    groups = rewards.double().view(3, 8)
    expected = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, correction=0, keepdim=True) + 1e-6)
    torch.testing.assert_close(adv, expected.view(24), rtol=0, atol=1e-12)
    equal = torch.tensor([0.1] * 7 + [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=F64)
    adv, _ = batch_advantages(AdvantageSettings(), equal, rows([4] * 14, [2] * 14, 7))
    assert torch.equal(adv[:7], torch.zeros(7, dtype=F64)) and torch.isfinite(adv).all() and adv[7:].abs().sum() > 0
    alone, _ = batch_advantages(AdvantageSettings(), torch.tensor([3.0, -1.0]), rows([4, 4], [2, 2], 1))
    assert torch.equal(alone, torch.zeros(2, dtype=F64))
    integers, _ = batch_advantages(AdvantageSettings(), torch.tensor([0, 1, 1, 0]), rows([4] * 4, [2] * 4, 4))
    torch.testing.assert_close(integers, torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=F64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_rows_advantage_is_its_tokens_and_whitening_weighs_by_tokens(name):
    """Per row or per token, the same numbers on the trained tokens: gamma 1 without KL gives one
    per row; a tiny discount forces the per-token path, which must agree to first order."""
    r = rows([5, 6, 4, 7, 3, 8, 5, 5], [3, 4, 2, 5, 1, 6, 3, 2], 4)
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=F64)
    s = AdvantageSettings(advantage_estimator=name, whiten_advantages=True)
    per_row, _ = batch_advantages(s, rewards, r)
    assert per_row.shape == (8,)
    if ESTIMATORS[name].kind == "return":
        near, _ = batch_advantages(AdvantageSettings(advantage_estimator=name, whiten_advantages=True,
                                                     estimator_args={"gamma": 1 - 1e-9}), rewards, r)
        assert near.shape == r.loss_mask.shape
        spread = torch.repeat_interleave(per_row, r.lengths)
        torch.testing.assert_close(near[r.loss_mask], spread[r.loss_mask], rtol=0, atol=1e-7)
    trained = r.trained
    mean = (per_row * trained).sum() / trained.sum()
    assert abs(float(mean)) < 1e-12  # whitened over the batch's tokens


def _episode(group, index, turns, rewards):
    s = Sample(group, index, {}, [7, 7], 20)
    s.response_ids = list(range(3 * turns))
    s.loss_mask = [1, 1, 0] * turns
    s.metadata = {"spans": [["model", 3 * k, 3 * k + 2] for k in range(turns)], "turn_rewards": rewards}
    return s


def test_per_turn_credit_for_a_return_estimator():
    """reinforce sees each turn's reward on the turn's last token: with gamma 1 every token of turn
    k gets the rewards from turn k on (the group estimators' G_{i,k} without their baseline)."""
    eps = [_episode(0, 0, 3, [0.0, 1.0, 2.0]), _episode(0, 1, 1, [3.0])]
    adv = turn_credit_advantages(eps, 2, None, 1.0, AdvantageSettings(advantage_estimator="reinforce"))
    first = adv[:11]  # 2 prompt tokens + 9 response tokens
    assert first[2:4].tolist() == [3.0, 3.0] and first[5:7].tolist() == [3.0, 3.0] and first[8:10].tolist() == [2.0, 2.0]
    assert first[[0, 1, 4, 7, 10]].abs().sum() == 0  # prompt and environment tokens
    grpo = turn_credit_advantages(eps, 2, None, 1.0)
    assert grpo[2:4].tolist() == [0.0, 0.0]  # G_1 = 3 for both episodes: equal scores, zero everywhere


def test_the_driver_leaves_the_kl_in_the_reward_to_the_last_stage():
    samples = [[_episode(0, i, 1, [float(i)]) for i in range(4)]]
    for s in samples[0]:
        s.reward, s.logprobs, s.weight_versions = s.metadata["turn_rewards"][0], [-1.0] * 3, ["0"] * 3
        s.response_ids, s.loss_mask = s.response_ids[:3], [1, 1, 1]
        s.metadata = {}
    metrics = {}
    batch = samples_to_batch(samples, 4, advantage=AdvantageSettings(kl_in_reward_coef=0.1, reward_clip=2.5),
                             metrics=metrics)
    assert batch.advantages.tolist() == [0.0] * 4 and batch.rewards.tolist() == [0.0, 1.0, 2.0, 2.5]
    assert metrics == {"reward_clip_fraction": 0.25}
    plain = samples_to_batch(samples, 4)
    assert plain.advantages.abs().sum() > 0 and plain.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_per_token_decisions():
    assert not AdvantageSettings().per_token()
    assert AdvantageSettings().per_token("return_to_go")
    assert not AdvantageSettings(advantage_estimator="reinforce").per_token()
    assert AdvantageSettings(advantage_estimator="reinforce", estimator_args={"gamma": 0.9}).per_token()
    assert AdvantageSettings(advantage_estimator="reinforce_plus_plus", kl_in_reward_coef=0.1).per_token()
    assert not AdvantageSettings(advantage_estimator="rloo", kl_in_reward_coef=0.1).per_token()
    assert AdvantageSettings(advantage_estimator="reinforce").group_relative is False
    assert AdvantageSettings(advantage_estimator="reinforce", reward_norm_mean="group").group_relative
