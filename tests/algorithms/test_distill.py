"""On-policy distillation (docs/algorithm.md): the teacher's log-probs from SGLang equal
transformers', the per-token advantages and the GSPO-token loss equal a hand computation, TP2 and PP2
equal one process, a teacher with another vocabulary is refused at start, and a real run (student
and teacher on the session's servers) trains and reports distill/* metrics."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from fixtures_models import hf_response_logprobs, tiny_model_dir
from test_actor_layouts import _max_state_diff, _np
from test_trainer_e2e import ROOT, base_overrides, env, run_train, server_url  # noqa: F401  (a fixture)

CONFIG = "examples/tiny_moe_larger_digit.yaml"


# --- the teacher's log-probs --------------------------------------------------------------------
@pytest.mark.slow
def test_teacher_log_probs_equal_transformers(qwen3_server):
    from rollout.servers.pool import ServerPool
    teacher = tiny_model_dir("qwen3", 0)
    pool = ServerPool(qwen3_server.server_urls)
    g = torch.Generator().manual_seed(3)
    for prompt_len, response_len in ((7, 9), (20, 1), (3, 30)):
        ids = torch.randint(3, 512, (prompt_len + response_len,), generator=g).tolist()
        ids[-1] = 511  # the vocabulary's last id: SGLang reports it as 0, with its own log-prob
        want = hf_response_logprobs(teacher, ids[:prompt_len], ids[prompt_len:])
        for _ in range(2):  # the second time the prompt comes from the radix cache
            got = pool.input_log_probs(ids, prompt_len)
            assert len(got) == response_len
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    pool.close()


# --- the estimator, by hand ---------------------------------------------------------------------
def test_advantages_and_loss_by_hand():
    from gspo_megatron.algorithms.distill import distillation_advantages, reverse_kl
    from gspo_megatron.algorithms.gspo import gspo_token_loss
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0], [0.0, 0.0, -0.3, -1.2, -2.0]])
    teacher = torch.tensor([[9.0, -0.5, -2.5, -0.5, 9.0], [9.0, 9.0, -0.1, -3.2, -1.0]])
    seq_adv = torch.tensor([1.0, -1.0])
    adv = distillation_advantages(seq_adv, old, teacher, mask, coef=2.0, reward_coef=0.5)
    want = torch.tensor([[0, 0.5 + 2 * 0.5, 0.5 + 2 * -0.5, 0.5 + 0, 0],
                         [0, 0, -0.5 + 2 * 0.2, -0.5 + 2 * -2.0, -0.5 + 2 * 1.0]])
    assert torch.allclose(adv, want)
    assert reverse_kl(old, teacher, mask) == pytest.approx((-0.5 + 0.5 + 0 - 0.2 + 2.0 - 1.0) / 6)
    # on-policy (theta = old): every token ratio is 1, nothing is clipped, and the loss is
    # -mean_i (1/L_i) sum_t A_it; the gradient w.r.t. log pi(y_t) is -A_it / (G L_i)
    log_probs = old.clone().requires_grad_(True)
    loss, _ = gspo_token_loss(log_probs, old, adv, mask)
    rows = [adv[i][mask[i]].mean() for i in range(2)]
    assert float(loss.detach()) == pytest.approx(-float(sum(rows)) / 2, abs=1e-6)
    loss.backward()
    want_grad = torch.where(mask, -adv / (2 * mask.sum(dim=1, keepdim=True)), torch.zeros_like(adv))
    assert torch.allclose(log_probs.grad, want_grad, atol=1e-6)
    # pure distillation: the task advantage does not count
    pure = distillation_advantages(seq_adv, old, teacher, mask, coef=1.0, reward_coef=0.0)
    assert torch.allclose(pure, torch.where(mask, teacher - old, torch.zeros_like(old)))


# --- TP2 and PP2 equal one process --------------------------------------------------------------
ROWS, SEQ, MINI = 8, 20, 2


def _batch():
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(8, SEQ + 1, (ROWS,), generator=g)
    t = torch.arange(SEQ)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(0, 512, (ROWS, SEQ), generator=g), 0)
    mask = (t >= 4) & (t < lengths[:, None])
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=torch.randn(ROWS, generator=g),
                      rollout_log_probs=-6.0 + 0.1 * torch.randn(ROWS, SEQ, generator=g),
                      teacher_log_probs=-6.0 + torch.randn(ROWS, SEQ, generator=g))


def _distill_run(rank, world, layout_kwargs, init_state):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings, OptimizerSettings
    from gspo_megatron.algorithms.distill import distillation_advantages
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe
    actor = Actor(qwen3_moe(), ParallelLayout(**layout_kwargs),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0),
                  loss=LossSettings(name="gspo_token", eps_low=0.02, eps_high=0.002),
                  batching=MicroBatchSettings(micro_batch_size=2), seed=11 + rank)
    made = None
    if init_state is None:
        made = _np(actor.full_state_dict())
    else:
        actor.load_full_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    shard = actor.shard(_batch(), num_mini_batches=MINI)
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    if shard.old_log_probs is not None:  # the last stage, as the trainer does
        shard.advantages = distillation_advantages(shard.advantages, shard.old_log_probs, shard.teacher_log_probs,
                                                   shard.loss_mask, coef=1.0, reward_coef=0.5)
    metrics, states = [], []
    for mini in shard.mini_batches():
        metrics.append(actor.train_step(mini))
        states.append(_np(actor.full_state_dict(to_all_ranks=False)))
    return dict(metrics=metrics, states=states if rank == 0 else None, init=made if rank == 0 else None)


@pytest.fixture(scope="module")
def distill_reference():
    return run_distributed(_distill_run, 1, ({}, None), timeout=180)[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor=2), dict(pipeline=2)], ids=["tp2", "pp2"])
def test_distillation_tp2_pp2_equal_one_process(distill_reference, layout):
    ref = distill_reference
    assert _max_state_diff(ref["states"][0], ref["init"]) > 1e-2  # the step is large enough to see a scale error
    results = run_distributed(_distill_run, 2, (layout, ref["init"]), timeout=420)
    for step, (mine, want) in enumerate(zip(results[0]["states"], ref["states"])):
        assert _max_state_diff(mine, want) <= 1e-5, f"parameters after step {step + 1}"
    for mine, want in zip(results[0]["metrics"], ref["metrics"]):
        assert mine["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5)


# --- refused at start ---------------------------------------------------------------------------
def test_a_teacher_with_another_vocabulary_is_refused_before_any_server(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir("qwen3", 0), teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap their ids
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", CONFIG,
                           *base_overrides(run, "http://127.0.0.1:9", **{
                               "distill.teacher": str(teacher), "loss.name": "gspo_token",
                               "distill.reward_coef": 0})],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"gspo-megatron: error: distill.teacher='{teacher}' has another vocabulary: ")
    assert "2 have other ids" in line and "needs the student's tokenizer" in line
    assert "SGLang" not in proc.stdout  # no server was started or attached


def test_a_teacher_that_cannot_load_is_refused_before_any_server(tmp_path):
    """A teacher whose config.json says more tokens than its weights hold: SGLang would load for a
    minute and fail naming "the sglang server"; the start-up checks name the teacher and the tensor."""
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir("qwen3", 0), teacher)
    config = json.loads((teacher / "config.json").read_text())
    vocab = config["vocab_size"]
    config["vocab_size"] = vocab + 128
    (teacher / "config.json").write_text(json.dumps(config))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", CONFIG,
                           *base_overrides(run, "http://127.0.0.1:9", **{
                               "distill.teacher": str(teacher), "loss.name": "gspo_token",
                               "distill.reward_coef": 0, "rollout.server_urls": "[]"})],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"gspo-megatron: error: distill.teacher='{teacher}' cannot "
                                                   "be loaded: "), proc.stderr[-3000:]
    assert f"config.json implies ({vocab + 128}, " in lines[0] and "(vocab_size, hidden_size)" in lines[0]
    assert "SGLang" not in proc.stdout and not (run / "ckpt").exists()  # nothing started or written


# --- a real run ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_distillation_run_trains_and_reports(tmp_path, server_url, qwen3_server):  # noqa: F811
    """Student: the tiny MoE on the module's server; teacher: the tiny dense Qwen3 on its own server
    (the same tokenizer), which the run never syncs."""
    from gspo_megatron.run.metrics import read_jsonl
    from rollout.servers.client import SGLangClient
    teacher_url = qwen3_server.server_urls[0]
    before = SGLangClient(teacher_url).weight_version()
    proc = run_train([CONFIG, *base_overrides(tmp_path, server_url, **{
        "loss.name": "gspo_token", "distill.teacher": str(tiny_model_dir("qwen3", 0)),
        "distill.teacher_server_urls": f"[{teacher_url}]", "distill.reward_coef": 0, "train.steps": 2,
        "logging.rollout_records": str(tmp_path / "records.jsonl")})])
    assert proc.returncode == 0, proc.stderr[-5000:]
    recs = read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/teacher_tokens_per_s"] > 0
    from gspo_megatron.run.metrics import documented
    assert all(documented(k) for k in recs[0] if k != "step"), [k for k in recs[0] if not documented(k)]
    samples = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    want = hf_response_logprobs(tiny_model_dir("qwen3", 0), samples[0]["prompt_ids"], samples[0]["response_ids"])
    assert max(abs(a - b) for a, b in zip(samples[0]["teacher_logprobs"], want)) < 1e-5
    assert SGLangClient(teacher_url).weight_version() == before  # the teacher never got the student's weights
