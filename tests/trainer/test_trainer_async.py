"""Asynchronous RL (train.max_staleness > 0): rollouts overlap training, staleness is bounded, and
pi_old stays exact per token (docs/async.md).

- The actor: pi_old recomputed per token with the weights of the version that generated it, equal
  to a forward pass with those weights (one process, fp32).
- Real runs (`gspo-megatron train` against the session's SGLang server, rollout records on): no
  trained token is older than max_staleness versions; the recomputed pi_old equals SGLang's
  log-probs of the generating version (as on-policy), also for responses cut by a weight sync
  (two versions); SIGKILL + resume trains every prompt once; TP2 and PP2 equal one process.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from test_trainer_e2e import ROOT, base_overrides, env, run_train, server_url, train_cmd  # noqa: F401

CONFIG = "examples/tiny_moe_larger_digit.yaml"


# --- the actor: per-token pi_old from the generating version's weights ---------------------------
def _versioned(rank, world):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.batching.batch import TrainBatch
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    g = torch.Generator().manual_seed(0)
    lengths, t = torch.tensor([16, 12, 16, 9]), torch.arange(16)[None]
    mask = (t >= 4) & (t < lengths[:, None])
    versions = torch.where(t < 10, 5, 6).expand(4, 16).clone()  # a response cut by a sync at position 10
    versions[~mask] = -1
    batch = TrainBatch(tokens=torch.randint(0, 512, (4, 16), generator=g), lengths=lengths, loss_mask=mask,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), weight_versions=versions,
                       rollout_log_probs=torch.zeros(4, 16))
    actor = Actor(tiny_hf_config(), ParallelLayout(), optimizer=OptimizerSettings(optimizer="sgd", lr=0.5),
                  loss=LossSettings(name="gspo", eps_low=0.5, eps_high=0.5), micro_batch_size=2, max_staleness=1)
    shard = actor.shard(batch)
    v5, _ = actor.compute_old_log_probs(shard)          # the weights of version 5
    actor.keep_version(5)
    shard.old_log_probs = v5
    actor.train_step(shard)                              # the weights of version 6
    v6, _ = actor.compute_old_log_probs(shard)
    mixed, m = actor.compute_old_log_probs(shard, versions=[5, 6], live_version=6)
    after, _ = actor.compute_old_log_probs(shard)        # the live weights are back, bit for bit
    return dict(v5=v5, v6=v6, mixed=mixed, after=after, mask=mask, versions=versions, m=m,
                kept=actor.kept_versions())


@pytest.mark.slow
def test_pi_old_per_token_is_the_generating_versions():
    out = run_distributed(_versioned, 1, timeout=300)[0]
    mask, versions = out["mask"], out["versions"]
    old, new = mask & (versions == 5), mask & (versions == 6)
    assert (out["v5"] - out["v6"]).abs()[mask].max() > 1e-3  # the update moved the log-probs
    assert torch.equal(out["mixed"][old], out["v5"][old])
    assert torch.equal(out["mixed"][new], out["v6"][new])
    assert torch.equal(out["after"], out["v6"])
    assert out["m"]["versions"] == 2.0 and out["m"]["tokens"] == float(mask.sum())
    assert out["kept"] == [5]


# --- real runs ---------------------------------------------------------------------------------
def _args(run_dir: Path, url: str, **extra) -> list[str]:
    return [CONFIG, *base_overrides(run_dir, url, **{
        "train.steps": 5, "train.max_staleness": 1, "checkpoint.interval": 2,
        "logging.rollout_records": str(run_dir / "records.jsonl"), **extra})]


def _records(run_dir: Path) -> list[dict]:
    """The rollout records, the last run's where a step was written twice (a resume)."""
    rows = [json.loads(ln) for ln in (run_dir / "records.jsonl").read_text().splitlines()]
    last: dict[int, list[dict]] = {}
    for r in rows:
        if r["row"] == 0:
            last[r["step"]] = []
        last[r["step"]].append(r)
    return [r for s in sorted(last) for r in last[s]]


def _versions(r: dict) -> list[int]:
    return sorted({int(v) for v, m in zip(r["weight_versions"], r["loss_mask"]) if m})


def _check_staleness(run_dir: Path, n: int) -> dict[str, list[float]]:
    """No trained token older than n versions: the trainer holds version step + 1 at step `step`
    (the first sync, before step 0, is version 1)."""
    from gspo_megatron.run.metrics import read_scalars
    for r in _records(run_dir):
        live = r["step"] + 1
        assert all(live - v <= n for v in _versions(r)), (r["step"], _versions(r))
    scalars = read_scalars(run_dir / "tb")
    assert all(v <= n for _, v in scalars["async/staleness_max"])
    return {k: [v for _, v in pts] for k, pts in scalars.items()}


@pytest.mark.slow
def test_async_run_bounded_staleness_and_exact_pi_old_across_syncs(tmp_path, server_url):  # noqa: F811
    """N = 1, pi_old recomputed. Long responses (ignore_eos) make weight syncs cut responses in
    two; their tokens carry two versions, and the recomputed pi_old still equals SGLang's."""
    proc = run_train(_args(tmp_path, server_url, **{"rollout.ignore_eos": "true", "rollout.max_new_tokens": 96,
                                                    "train.steps": 6}))
    assert proc.returncode == 0, proc.stderr[-5000:]
    s = _check_staleness(tmp_path, 1)
    assert max(s["async/staleness_mean"]) > 0, s["async/staleness_mean"]  # it did run ahead
    two = [r for r in _records(tmp_path) if len(_versions(r)) == 2]
    assert two, "no response was cut by a weight sync"
    # pi_old recomputed per token with the generating version == SGLang's log-probs of it.
    assert all(v < 1e-4 for v in s["train/logprob_abs_diff"]), s["train/logprob_abs_diff"]
    for tag in ("async/rollout_busy", "async/train_busy", "async/overlap", "async/buffer_groups"):
        assert len(s[tag]) == 6, tag
    assert max(s["async/overlap"]) > 0
    print("staleness", s["async/staleness_mean"], "overlap", s["async/overlap"],
          "logprob diff", s["train/logprob_abs_diff"], "cut responses", len(two))


@pytest.mark.slow
def test_async_engine_pi_old_and_drop_policy(tmp_path, server_url):  # noqa: F811
    proc = run_train(_args(tmp_path, server_url, **{"train.old_log_probs": "engine", "train.max_staleness": 2,
                                                    "rollout.stale_policy": "drop"}))
    assert proc.returncode == 0, proc.stderr[-5000:]
    _check_staleness(tmp_path, 2)


def _trained_prompts(run_dir: Path) -> list[tuple]:
    return [tuple(r["prompt_ids"]) for r in _records(run_dir) if r["index"] == 0]


@pytest.mark.slow
def test_async_sigkill_and_resume_trains_every_prompt_once(tmp_path, server_url):  # noqa: F811
    from gspo_megatron.run.metrics import read_jsonl
    args = _args(tmp_path, server_url, **{"train.steps": 6, "checkpoint.keep": 0})
    log = tmp_path / "first_run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(train_cmd(1) + args, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)
    marker = tmp_path / "ckpt" / "step_00000002" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # At once: the rollout thread already runs ahead of the checkpoint (a step takes 0.1-0.3 s
    # here). checkpoint.keep=0: with keep=2, step 6's save deleted step 2's checkpoint, and a wait
    # of 1.5 s (or a stalled poll on a loaded machine) outlived it.
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}:\n" + log.read_text()[-5000:]
    assert marker.exists(), log.read_text()[-5000:]
    resumed = run_train(args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-5000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)] == list(range(6))
    prompts = _trained_prompts(tmp_path)
    assert len(prompts) == 12 and len(set(prompts)) == 12, "a prompt trained twice"
    _check_staleness(tmp_path, 1)


def _lockstep(run_dir: Path, url: str) -> list[str]:
    """Deterministic async: greedy rollouts, lr 0 (every version the same weights), one batch
    buffered (never stale): the batches are those of a synchronous run, however the threads run."""
    return _args(run_dir, url, **{"rollout.top_k": 1, "train.lr": 0.0, "train.warm_start_steps": 0,
                                  "train.steps": 3, "rollout.max_buffered_groups": 2})


@pytest.fixture(scope="module")
def lockstep_one_process(tmp_path_factory, server_url):  # noqa: F811
    """The one-process run both layouts compare against (run once)."""
    run_dir = tmp_path_factory.mktemp("async_one")
    one = run_train(_lockstep(run_dir, server_url))
    assert one.returncode == 0, one.stderr[-5000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tensor", "pipeline"])
def test_async_tp2_and_pp2_equal_one_process(tmp_path, server_url, lockstep_one_process, layout):  # noqa: F811
    from gspo_megatron.run.metrics import read_jsonl
    one_dir = lockstep_one_process
    two = run_train(_lockstep(tmp_path / "two", server_url) + ["--set", f"parallel.{layout}=2"], nproc=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    a, b = read_jsonl(one_dir / "tb" / "metrics.jsonl", steps_only=True), read_jsonl(tmp_path / "two" / "tb" / "metrics.jsonl", steps_only=True)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        for k in ("train/loss", "train/grad_norm", "train/logprob_abs_diff", "rollout/reward_mean",
                  "train/seq_ratio_mean", "async/staleness_max"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (ra["step"], k, ra[k], rb[k])
    def per_step(run_dir):  # groups join a batch as they complete: compare each step's set
        out = {}
        for r in _records(run_dir):
            if r["index"] == 0:
                out.setdefault(r["step"], set()).add(tuple(r["prompt_ids"]))
        return out
    assert per_step(one_dir) == per_step(tmp_path / "two")


@pytest.mark.slow
def test_async_multiturn_episodes(tmp_path, server_url):  # noqa: F811
    """Episodes of the calculator tool under max_staleness 1: an episode cut at a turn by a weight
    sync restarts; every trained model token is at most one version old."""
    sets = {"rollout.environment": "calculator", "rollout.max_turns": 3,
            "rollout.prompts": "examples/data/calculator.jsonl", "rollout.group_size": 4,
            "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 128, "rollout.max_turn_tokens": 12,
            "train.steps": 3, "train.warm_start_steps": 0, "train.max_staleness": 1,
            "logging.rollout_records": str(tmp_path / "records.jsonl")}
    proc = run_train(["examples/tiny_moe_calculator.yaml", *base_overrides(tmp_path, server_url, **sets)])
    assert proc.returncode == 0, proc.stderr[-5000:]
    s = _check_staleness(tmp_path, 1)
    assert len(s["rollout/turns_per_episode"]) == 3 and all(v >= 1 for v in s["rollout/turns_per_episode"])
    assert all(v < 1e-4 for v in s["train/logprob_abs_diff"]), s["train/logprob_abs_diff"]


@pytest.mark.slow
def test_async_routing_replay_staleness_2(tmp_path):
    """moe.replay with max_staleness 2, the run's own server (it must return routed experts): a
    response cut by a weight sync resumes under the new weights, each token keeping the routes of
    the pass that sampled it (rollout/in_server/released_routes.py, actor/held/versioned_routes.py); so
    pi_old recomputed per version, replaying that version's routes, still equals SGLang's
    log-probs, the recorded routes are what their version's weights choose, and the checked
    samples are paired. (Replaying every recorded route in every version's pass would route the
    later version's context as the earlier one did: pi_old was then off by 1e-4 to 1.6e-3.)"""
    from fixtures_models import tiny_model_dir
    from gspo_megatron.run.metrics import read_jsonl
    from test_trainer_e2e import PROMPTS
    sets = {"model.hf_path": str(tiny_model_dir("qwen3_moe", 0)), "rollout.prompts": str(PROMPTS),
            "rollout.reward": "exact_match", "rollout.group_size": 4, "rollout.prompts_per_step": 2,
            "rollout.max_new_tokens": 96, "rollout.ignore_eos": "true", "train.steps": 4,
            "train.mini_batches": 2, "train.micro_batch_size": 4, "train.lr": 1e-3, "train.max_staleness": 2,
            "rollout.max_buffered_groups": 4,  # the thread generates while the trainer syncs
            "moe.replay": "true", "checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.interval": 100,
            "logging.tensorboard_dir": str(tmp_path / "tb"),
            "logging.rollout_records": str(tmp_path / "records.jsonl")}
    proc = run_train([CONFIG, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]], timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    s = _check_staleness(tmp_path, 2)
    assert all(v < 1e-4 for v in s["train/logprob_abs_diff"]), s["train/logprob_abs_diff"]
    assert all(v == 0.0 for v in s["routing/replay_mismatch"]), s["routing/replay_mismatch"]
    assert all(v < 0.01 for v in s["routing/version_mismatch"]), s["routing/version_mismatch"]
    assert sum(s["rollout/alignment_checked"]) > 0 and not any(s["rollout/misaligned"]), s["rollout/misaligned"]
    two = [r for r in _records(tmp_path) if len(_versions(r)) >= 2]
    steps = read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)
    print(f"responses cut by a sync and resumed: {len(two)}; resumed samples "
          f"{sum(r.get('rollout/partial_resumed', 0.0) for r in steps):.0f}")
    assert two  # responses were cut by syncs and trained with tokens of two versions
