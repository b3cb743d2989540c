"""The driver's hand-off: Samples -> TrainBatch (target alignment, env-token masks, advantages)
and the per-step metrics the loop derives from the actor's mini-batch metrics."""
from __future__ import annotations

import torch

from gspo_megatron.driver.samples_to_batch import samples_to_batch
from gspo_megatron.driver.warm_start import sft_batch
from gspo_megatron.driver.rollout_metrics import rollout_metrics
from gspo_megatron.run.loop_metrics import train_metrics
from rollout.generation.sample import Sample


def _sample(gid, idx, prompt, resp, reward, env_at=()):
    s = Sample(gid, idx, {"prompt": "p", "answer": "a"}, list(prompt), max_new_tokens=8)
    for j, t in enumerate(resp):
        if j in env_at:
            s.append_env_tokens([t])
        else:
            s.append_model_tokens([t], [-0.1 * (j + 1)], ["1"])
    s.reward = reward
    return s


def test_samples_to_batch_alignment_and_advantages():
    groups = [[_sample(0, 0, [5, 6, 7], [8, 9], 1.0), _sample(0, 1, [5, 6, 7], [10, 11, 12], 0.0,
                                                                 env_at=(1,))],
              [_sample(1, 0, [3], [4], 1.0), _sample(1, 1, [3], [4], 1.0)]]
    packed = samples_to_batch(groups, group_size=2)
    # the driver's batch holds the real tokens only, row after row (no padded batch on rank 0)
    assert packed.is_packed and packed.tokens.tolist() == [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 3, 4, 3, 4]
    assert packed.nbytes() == 15 * (8 + 1 + 4 + 8) + 4 * (8 + 4 + 4)  # tokens, mask, log-probs, versions; lengths, advantages, rewards
    b = packed.padded()
    assert b.tokens.tolist()[1] == [5, 6, 7, 10, 11, 12] and b.lengths.tolist() == [5, 6, 2, 2]
    # loss_mask[i, t] refers to token t (predicted from < t): the response tokens, env token off
    assert b.loss_mask[0].tolist() == [False, False, False, True, True, False]
    assert b.loss_mask[1].tolist() == [False, False, False, True, False, True]
    assert torch.allclose(b.rollout_log_probs[1, 3:6], torch.tensor([-0.1, 0.0, -0.3]))
    a = b.advantages.tolist()
    assert a[0] > 0 and abs(a[0] + a[1]) < 1e-6 and a[2:] == [0.0, 0.0]  # equal rewards: exactly 0
    m = rollout_metrics(groups, {"groups_dropped_equal_reward": 2.0})
    assert m["rollout/reward_mean"] == 0.75 and m["rollout/accuracy"] == 0.75
    assert m["rollout/response_length_max"] == 3 and m["rollout/groups_dropped"] == 2.0


def test_rollout_records_leave_the_advantages_of_the_last_stage_unknown(tmp_path):
    """With the KL in the reward the driver's batch holds placeholder advantages (0): the records say
    null, not 0.0 for every row; without it they hold the driver's advantages."""
    import json

    from gspo_megatron.algorithms.advantage.table import AdvantageSettings
    from gspo_megatron.driver.records import RolloutRecords
    groups = [[_sample(0, 0, [5, 6], [8, 9], 1.0), _sample(0, 1, [5, 6], [10], 0.0)]]
    for kl, path in ((0.1, tmp_path / "kl.jsonl"), (0.0, tmp_path / "plain.jsonl")):
        settings = AdvantageSettings(advantage_estimator="reinforce", kl_in_reward_coef=kl)
        batch = samples_to_batch(groups, group_size=2, advantage=settings)
        RolloutRecords(path, advantages_on_last_stage=settings.kl_in_reward).write(0, groups[0], batch)
    assert [json.loads(ln)["batch_advantages"] for ln in (tmp_path / "kl.jsonl").read_text().splitlines()] == [None, None]
    assert [json.loads(ln)["batch_advantages"] for ln in (tmp_path / "plain.jsonl").read_text().splitlines()] == [1.0, 0.0]


def test_sft_batch_trains_answer_tokens_only():
    b = sft_batch([([1, 2, 3], [7, 2]), ([1, 4], [9, 9, 2])])
    assert b.loss_mask.tolist() == [[False, False, False, True, True],
                                    [False, False, True, True, True]]


def test_train_metrics_aggregation():
    ups = [{"loss": 1.0, "clip_fraction": 0.5, "seq_ratio_mean": 1.0, "seq_ratio_min": 0.9,
            "seq_ratio_max": 1.1, "grad_norm": 2.0, "lr": 1e-3, "entropy_mean": 3.0},
           {"loss": 3.0, "clip_fraction": 0.0, "seq_ratio_mean": 1.2, "seq_ratio_min": 0.8,
            "seq_ratio_max": 1.3, "grad_norm": 4.0, "lr": 2e-3, "entropy_mean": 5.0,
            "logprob_abs_diff_vs_rollout": 0.2}]
    m = train_metrics(ups, {"entropy_mean": 7.0, "logprob_abs_diff_vs_rollout": 1e-7})
    assert m["train/loss"] == 2.0 and m["train/clip_fraction"] == 0.25
    assert m["train/seq_ratio_min"] == 0.8 and m["train/seq_ratio_max"] == 1.3
    assert m["train/lr"] == 2e-3 and m["train/entropy"] == 7.0
    assert m["train/logprob_abs_diff"] == 1e-7 and "train/kl" not in m
