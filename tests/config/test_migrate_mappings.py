"""Every estimator-and-shaping mapping `migrate` offers, end to end: a peer's config is migrated,
our advantage pipeline runs on the migrated config (shape_rewards, the KL in the reward,
batch_advantages), and the result equals the peer's own formula, transcribed in
tests/algorithms/test_peer_{roll,verl,slime}.py from its functions, on random ragged groups (equal
and binary ones among them) with the configured clips biting (fp64, 1e-12). A planted change of
order (a clip before the norm, the advantage clip before the whitening, the KL after the group
norm, the mapping's own earlier choices) fails the same comparison.

What the transcription tests there cover already: each formula against settings written by hand.
What this adds: the settings are the ones migrate writes from the peer's keys, so a mapping that
names every key but applies them in another order, or to another estimator, fails here.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages, shape_rewards
from gspo_megatron.algorithms.advantage.shaping import RunningMoments, normalize_rewards
from gspo_megatron.algorithms.kl import token_kl
from gspo_megatron.config import config_from_dict
from gspo_megatron.config.peers import migrate
from peer_cases import make_case, outcome_rewards
from test_peer_roll import RollRunningMoments, roll_advantages
from test_peer_slime import slime_approx_kl, slime_distributed_masked_whiten, slime_group_norm, slime_rf_pp_returns
from test_peer_verl import (verl_grpo, verl_kl_penalty, verl_reinforce_plus_plus, verl_reinforce_plus_plus_baseline,
                            verl_rloo)

TOL = dict(rtol=0, atol=1e-12)
SEEDS = [0, 1, 2]
G = 4  # the cases' group size, written into every peer config
NEEDED = ["model.hf_path=m", "rollout.prompts=p"]


def migrated(tmp_path: Path, peer: str, text: str):
    """The run config `migrate` makes of a peer's file (checked by the trainer's own checks)."""
    f = tmp_path / {"roll": "roll.yaml", "verl": "verl.txt", "slime": "slime.sh"}[peer]
    f.write_text(text)
    return config_from_dict(migrate(peer, f, NEEDED).nested())


def ours(cfg, case, running: RunningMoments | None = None, rewards: torch.Tensor | None = None):
    """Our advantages on the migrated config, in the peers' [b, R] form, and the pipeline's metrics."""
    lengths, loss_mask = case.packed
    rows = BatchRows(lengths, loss_mask, torch.tensor(case.index), max(case.index) + 1)
    shaped, m1 = shape_rewards(cfg.loss, case.rewards if rewards is None else rewards, cfg.rollout.group_size, running)
    kl = None
    if cfg.loss.kl_in_reward:
        kl = case.from_peer(token_kl(case.old_log_probs, case.ref_log_probs, cfg.loss.kl_in_reward_estimator))
    adv, m2 = batch_advantages(cfg.loss, shaped, rows, kl=kl)
    adv = case.to_peer(adv) if adv.numel() != case.rewards.numel() else adv[:, None] * case.mask
    return adv.double(), {**m1, **m2}


def bites(metrics: dict, cfg) -> None:
    """Each configured clip clipped some values and left others."""
    for field, key in (("reward_clip", "reward_clip_fraction"), ("advantage_clip", "advantage_clip_fraction")):
        if getattr(cfg.loss, field) is not None:
            assert 0 < metrics[key] < 1, (field, metrics)


# --- ROLL: reward_postprocess (norm, clip) -> compute_token_reward (KL, clip) -> compute_advantage -------
def _one_large_reward(case):
    """Rewards x3 and one of 40: the reward clip at 10 takes it, and its whitened advantage is past 2."""
    case.rewards = case.rewards * 3
    case.rewards[-1] = 40.0


ROLL = {  # name: (ROLL's keys, roll_advantages' arguments, what the case needs for the clips to bite)
    "reinforce, batch norm, clip, whiten, advantage clip": (
        "adv_estimator: reinforce\nnorm_mean_type: batch\nnorm_std_type: batch\nreward_clip: 0.8\n"
        "whiten_advantages: true\nadvantage_clip: 0.9\n",
        dict(norm=("batch", "batch"), reward_clip=0.8, whiten=True, advantage_clip=0.9), None),
    "reinforce, reward_norm group + reward_shift, clip": (
        "adv_estimator: reinforce\nreward_norm: group\nreward_shift: true\nreward_clip: 0.5\n",
        dict(norm=("group", None), reward_clip=0.5), None),
    "reinforce, norm group / batch, gamma 0.9, token KL (k3), clip, whiten": (
        "adv_estimator: reinforce\nnorm_mean_type: group\nnorm_std_type: batch\ngamma: 0.9\nadd_token_level_kl: true\n"
        "init_kl_coef: 0.3\nkl_penalty: k3\nreward_clip: 0.7\nwhiten_advantages: true\nadvantage_clip: 1.2\n",
        dict(norm=("group", "batch"), gamma=0.9, kl_coef=0.3, kl_penalty="k3", reward_clip=0.7, whiten=True,
             advantage_clip=1.2), None),
    "grpo": ("adv_estimator: grpo\n", dict(norm=("group", "group")), None),
    "grpo, reward clip, whiten, advantage clip": (
        "adv_estimator: grpo\nreward_clip: 0.9\nwhiten_advantages: true\nadvantage_clip: 1.1\n",
        dict(norm=("group", "group"), reward_clip=0.9, whiten=True, advantage_clip=1.1), None),
    "grpo, token KL (mse), clip": (
        "adv_estimator: grpo\nadd_token_level_kl: true\ninit_kl_coef: 0.2\nkl_penalty: mse\nreward_clip: 0.9\n",
        dict(norm=("group", "group"), kl_coef=0.2, kl_penalty="mse", reward_clip=0.9), None),
    "the seed's block (reinforce, whiten, advantage clip 2, reward clip 10)": (
        (Path(__file__).parent / "peer_configs" / "roll_gspo.yaml").read_text().replace(
            "num_return_sequences_in_group: 8\n", ""),
        dict(reward_clip=10.0, whiten=True, advantage_clip=2.0), _one_large_reward),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(ROLL))
def test_roll_mappings(tmp_path, name, seed):
    keys, peer_args, prepare = ROLL[name]
    cfg = migrated(tmp_path, "roll", keys + f"num_return_sequences_in_group: {G}\n")
    case = make_case(seed)
    if prepare is not None:
        prepare(case)
    got, metrics = ours(cfg, case)
    torch.testing.assert_close(got, roll_advantages(case, **peer_args), **TOL)
    bites(metrics, cfg)


def test_roll_running_norm_over_steps(tmp_path):
    cfg = migrated(tmp_path, "roll", f"adv_estimator: reinforce\nreward_norm: running\nreward_scale: true\n"
                                     f"reward_clip: 1.5\nnum_return_sequences_in_group: {G}\n")
    theirs, mine = RollRunningMoments(), RunningMoments()
    for step in range(3):
        case = make_case(20 + step)
        got, metrics = ours(cfg, case, running=mine)
        torch.testing.assert_close(got, roll_advantages(case, norm=(None, "running"), running=theirs, reward_clip=1.5),
                                   **TOL)
        bites(metrics, cfg)


def test_roll_planted_orders_fail(tmp_path):
    """The same comparisons, with the order changed where it matters: each differs from ROLL."""
    case = make_case(0)
    keys, peer_args, _ = ROLL["reinforce, batch norm, clip, whiten, advantage clip"]
    cfg = migrated(tmp_path, "roll", keys + f"num_return_sequences_in_group: {G}\n")
    want = roll_advantages(case, **peer_args)
    # (a) the reward clip before the norm
    clipped_first = case.rewards.clamp(-0.8, 0.8)
    cfg.loss.reward_clip = None
    planted, _ = ours(cfg, case, rewards=clipped_first)
    assert not torch.allclose(planted, want, **TOL)
    # (b) the advantage clip before the whitening
    cfg.loss.reward_clip, clip, cfg.loss.advantage_clip, cfg.loss.whiten_advantages = 0.8, 0.9, None, False
    unwhitened, _ = ours(cfg, case)
    lengths = case.mask.sum()
    x = unwhitened.clamp(-clip, clip)
    mean = (x * case.mask).sum() / lengths
    var = (((x - mean) ** 2) * case.mask).sum() / (lengths - 1)
    planted = (x - mean) * torch.rsqrt(var + 1e-8) * case.mask
    assert not torch.allclose(planted, want, **TOL)
    # (c) ROLL's grpo with a reward clip as the grpo estimator (the clip on the raw rewards, the
    # group norm after it): what migrate wrote before this test
    keys, peer_args, _ = ROLL["grpo, reward clip, whiten, advantage clip"]
    want = roll_advantages(case, **peer_args)
    cfg = migrated(tmp_path, "roll", keys + f"num_return_sequences_in_group: {G}\n")
    assert cfg.loss.advantage_estimator == "reinforce" and cfg.loss.reward_norm_mean == "group"
    as_before = config_from_dict({"model": {"hf_path": "m"}, "rollout": {"prompts": "p", "group_size": G}, "loss": {
        "advantage_estimator": "grpo", "estimator_args": {"group_std": "unbiased"}, "reward_clip": 0.9,
        "whiten_advantages": True, "advantage_clip": 1.1}})
    planted, _ = ours(as_before, case)
    assert not torch.allclose(planted, want, **TOL)


# --- verl: apply_kl_penalty (the KL in the reward) -> compute_advantage ------------------------------
VERL = {  # name: (verl's keys, the peer's formula on (case, token_level_rewards))
    "grpo": ("algorithm.adv_estimator=grpo", lambda c, r: verl_grpo(r, c.mask, c.index)),
    "grpo without the std": ("algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=false",
                             lambda c, r: verl_grpo(r, c.mask, c.index, norm_adv_by_std_in_grpo=False)),
    "rloo": ("algorithm.adv_estimator=rloo", lambda c, r: verl_rloo(r, c.mask, c.index)),
    "reinforce_plus_plus, gamma 0.9": ("algorithm.adv_estimator=reinforce_plus_plus algorithm.gamma=0.9",
                                       lambda c, r: verl_reinforce_plus_plus(r, c.mask, 0.9)),
    "reinforce_plus_plus_baseline": ("algorithm.adv_estimator=reinforce_plus_plus_baseline",
                                     lambda c, r: verl_reinforce_plus_plus_baseline(r, c.mask, c.index)),
}
KL_IN_REWARD = [None, ("low_var_kl", 0.05), ("kl", 0.2), ("mse", 0.3), ("abs", 0.1)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kl", KL_IN_REWARD, ids=lambda k: "no KL" if k is None else f"KL {k[0]}")
@pytest.mark.parametrize("name", sorted(VERL))
def test_verl_mappings(tmp_path, name, kl, seed):
    keys, formula = VERL[name]
    text = keys + f" actor_rollout_ref.rollout.n={G} actor_rollout_ref.actor.policy_loss.loss_mode=gspo"
    if kl:
        text += f" algorithm.use_kl_in_reward=true algorithm.kl_penalty={kl[0]} algorithm.kl_ctrl.kl_coef={kl[1]}"
    cfg = migrated(tmp_path, "verl", text + "\n")
    assert cfg.loss.spec.takes_token_advantages or not cfg.loss.per_token()
    case = make_case(seed)
    rewards = outcome_rewards(case)
    if kl:
        rewards = rewards - kl[1] * verl_kl_penalty(case.old_log_probs, case.ref_log_probs, kl[0]) * case.mask
    got, _ = ours(cfg, case)
    torch.testing.assert_close(got, formula(case, rewards), **TOL)


def test_verl_planted_order_fails(tmp_path):
    """The KL subtracted after the group norm instead of before it differs from verl."""
    case = make_case(1)
    text = (f"algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n={G} algorithm.use_kl_in_reward=true "
            "algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.2\n")
    cfg = migrated(tmp_path, "verl", text)
    kld = verl_kl_penalty(case.old_log_probs, case.ref_log_probs, "kl") * case.mask
    want = verl_grpo(outcome_rewards(case) - 0.2 * kld, case.mask, case.index)
    torch.testing.assert_close(ours(cfg, case)[0], want, **TOL)
    planted = verl_grpo(outcome_rewards(case), case.mask, case.index) - 0.2 * kld.sum(-1, keepdim=True) * case.mask
    assert not torch.allclose(planted, want, **TOL)


# --- slime: _post_process_rewards (group norm) -> compute_advantages_and_returns -> whiten ------------
def _per_sample(case, values):
    out = torch.zeros_like(case.mask)
    for i, n in enumerate(case.lengths.tolist()):
        out[i, :n] = values[i]
    return out * case.mask


def _whiten(case, adv):
    keep = [i for i, n in enumerate(case.lengths.tolist()) if n]
    flat = slime_distributed_masked_whiten(torch.cat([adv[i, :case.lengths[i]] for i in keep]),
                                           torch.cat([case.mask[i, :case.lengths[i]] for i in keep]))
    out = torch.zeros_like(adv)
    for i, part in zip(keep, torch.split(flat, [int(case.lengths[i]) for i in keep])):
        out[i, :case.lengths[i]] = part
    return out


def _slime_rpp(case, kl_type, kl_coef, gamma):
    keep = [i for i, n in enumerate(case.lengths.tolist()) if n]
    kl = slime_approx_kl(case.old_log_probs, case.ref_log_probs, kl_type)
    returns = slime_rf_pp_returns([case.rewards[i] for i in keep], [kl[i, :case.lengths[i]] for i in keep],
                                  [case.mask[i, :case.lengths[i]] for i in keep], kl_coef, gamma)
    out = torch.zeros_like(case.mask)
    for i, r in zip(keep, returns):
        out[i, :case.lengths[i]] = r
    return _whiten(case, out)


SLIME = {  # name: (slime's flags, the peer's formula on the case)
    "grpo": ("--advantage-estimator grpo", lambda c: _per_sample(c, slime_group_norm(c.rewards, G))),
    "gspo, normalize advantages": ("--advantage-estimator gspo --normalize-advantages",
                                   lambda c: _whiten(c, _per_sample(c, slime_group_norm(c.rewards, G)))),
    "grpo without the std": ("--advantage-estimator grpo --disable-grpo-std-normalization",
                             lambda c: _per_sample(c, slime_group_norm(c.rewards, G, std_normalization=False))),
    "grpo without the reward norm": ("--advantage-estimator grpo --disable-rewards-normalization",
                                     lambda c: _per_sample(c, c.rewards)),
    "reinforce_plus_plus, KL k2, gamma 0.9": (
        "--advantage-estimator reinforce_plus_plus --normalize-advantages --kl-coef 0.2 --kl-loss-type k2 --gamma 0.9",
        lambda c: _slime_rpp(c, "k2", 0.2, 0.9)),
    "reinforce_plus_plus": ("--advantage-estimator reinforce_plus_plus --normalize-advantages",
                            lambda c: _slime_rpp(c, "k1", 0.0, 1.0)),
    "reinforce_plus_plus_baseline": (
        "--advantage-estimator reinforce_plus_plus_baseline --normalize-advantages",
        lambda c: _whiten(c, _per_sample(c, slime_group_norm(c.rewards, G, std_normalization=False)))),
    "reinforce_plus_plus_baseline without the reward norm": (
        "--advantage-estimator reinforce_plus_plus_baseline --normalize-advantages --disable-rewards-normalization",
        lambda c: _whiten(c, _per_sample(c, c.rewards))),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SLIME))
def test_slime_mappings(tmp_path, name, seed):
    flags, formula = SLIME[name]
    cfg = migrated(tmp_path, "slime", f"ARGS=(\n  {flags}\n  --n-samples-per-prompt {G}\n)\n")
    case = make_case(seed)
    got, _ = ours(cfg, case)
    torch.testing.assert_close(got, formula(case), **TOL)


def test_slime_planted_mapping_fails(tmp_path):
    """reinforce_plus_plus_baseline with --disable-rewards-normalization as our
    reinforce_plus_plus_baseline (the group mean subtracted, which slime then skips): differs."""
    case = make_case(2)
    want = SLIME["reinforce_plus_plus_baseline without the reward norm"][1](case)
    as_before = config_from_dict({"model": {"hf_path": "m"}, "rollout": {"prompts": "p", "group_size": G},
                                  "loss": {"advantage_estimator": "reinforce_plus_plus_baseline"}})
    assert not torch.allclose(ours(as_before, case)[0], want, **TOL)
    assert torch.allclose(normalize_rewards(case.rewards, G, None, None), case.rewards)


def test_verl_reinforce_plus_plus_stops_its_return_at_environment_tokens_ours_sums_through():
    """Documented, not offered (docs/algorithm.md): on a multi-turn row (turns of trained tokens
    between environment spans of untrained ones, the reward on the last trained token) verl's
    REINFORCE++ resets its return at every untrained position, so an earlier turn gets none of the
    final reward; here, as ROLL's return, every turn gets it. With no span (single-turn) they agree."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(G, generator=g, dtype=torch.float64)
    turns = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.float64)  # turn, environment, turn, padding
    for mask_row, differs in ((turns, True), (torch.tensor([1.0] * 6 + [0.0] * 2, dtype=torch.float64), False)):
        mask = mask_row.expand(G, -1).clone()
        last = int(mask_row.nonzero()[-1])
        token_rewards = torch.zeros_like(mask)
        token_rewards[:, last] = rewards
        want = verl_reinforce_plus_plus(token_rewards, mask, 1.0)
        lengths = torch.full((G,), 1 + mask.shape[1])
        loss_mask = torch.cat([torch.cat([torch.zeros(1, dtype=torch.bool), m.bool()]) for m in mask])
        rows = BatchRows(lengths, loss_mask, torch.zeros(G, dtype=torch.long), 1)
        settings = config_from_dict({"model": {"hf_path": "m"}, "rollout": {"prompts": "p"},
                                     "loss": {"advantage_estimator": "reinforce_plus_plus"}}).loss
        adv, _ = batch_advantages(settings, rewards, rows)
        assert torch.allclose(adv[:, None] * mask, want, **TOL) != differs
        if differs:  # verl's first turn gets no return (0 before whitening): its tokens all alike
            assert torch.allclose(want[:, :3], want[0, 0].expand(G, 3), **TOL)
