"""What every model family's tests run (test_families.py, test_deepseek_v3.py, test_gpt_oss.py):
one batch, the Actor's log-probs, the weight sync's stream and one GSPO step per case, and the
comparison of a layout on gloo ranks with one process.

    cases = [(name, hf_dir, layout kwargs, megatron checkpoint), ...]
    one = run_distributed(run_cases, 1, (cases,))[0]            # {name: ..., name/stream, /step, /after}
    ranks = run_distributed(run_cases, 2, (layout_cases,))
    assert_layout_equals_one_process(ranks, case, one, name, hf_dir)

Adam with eps = 10 makes a step's update about gradient / 10, so that a wrong gradient under a
layout shows in the parameters after it even where the log-probs agree (it did: MLA's rope key
under TP2, gpt-oss's expert biases under TP2 x EP2, experts without EP under TP2 x ETP1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from distributed import gather_row_values

ROWS, SEQ, TOL = 6, 20, 1e-5


def make_batch():
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([20, 13, 20, 7, 16, 20])
    t = torch.arange(SEQ)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, 512, (ROWS, SEQ), generator=g), 0)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=(t >= 1) & (t < lengths[:, None]),
                      advantages=torch.randn(ROWS, generator=g))


def hf_log_probs(hf_dir: Path, zero_expert_bias: bool = False, edit_model=None,
                 **config_changes) -> torch.Tensor:
    """[ROWS, SEQ] log p(token t | tokens < t) from transformers (fp32) on make_batch(), NaN where
    undefined; zero_expert_bias: the e_score_correction_bias buffers set to 0 (GLM-4.5,
    DeepSeek-V3); edit_model(model): called on the built model; config_changes: the HF config
    changed (the controls)."""
    from fixtures_models import transformers_log_probs

    def edit(model):
        if zero_expert_bias:
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.zero_()
        if edit_model is not None:
            edit_model(model)

    batch = make_batch()
    return transformers_log_probs(hf_dir, batch.tokens, batch.lengths, edit, **config_changes)


def zero_params(suffixes: tuple[str, ...]):
    """An edit_model for hf_log_probs: the parameters whose names end with `suffixes` set to 0."""
    def edit(model):
        for name, p in model.named_parameters():
            if name.endswith(suffixes):
                p.data.zero_()
    return edit


def distance_from_transformers(one: dict, name: str, hf_dir: Path, **changes) -> float:
    """Max |log-prob| difference of case `name` of a run_cases result from transformers' on the
    valid positions; `changes`: hf_log_probs' (a control: transformers without a feature)."""
    got = gather_row_values([one[name]], ROWS, SEQ)
    return float((got - hf_log_probs(hf_dir, **changes))[valid()].abs().max())


def assert_one_process_equals_transformers(one: dict, name: str, hf_dir: Path) -> None:
    """Case `name` of a one-process run_cases result: log-probs within TOL of transformers', and
    the weight sync's stream equal to the HF file bit for bit."""
    err = distance_from_transformers(one, name, hf_dir)
    print(f"{name}: max |megatron - transformers| log-prob {err:.3g}")
    assert err <= TOL
    original = load_file(Path(hf_dir) / "model.safetensors")
    streamed = one[f"{name}/stream"]
    assert sorted(streamed) == sorted(original)
    assert all(torch.equal(streamed[k], t) for k, t in original.items())


def valid() -> torch.Tensor:
    return make_batch().loss_mask  # [ROWS, SEQ]: the positions that have a log-prob


def run_cases(rank, world, cases, bucket_bytes: int = 1 << 16):
    """Per case (name, HF dir, layout kwargs, megatron checkpoint): the Actor's old log-probs of
    make_batch(), on rank 0 the weight sync's stream of the model (HF names, full tensors) in
    buckets of `bucket_bytes`, then one GSPO step: its metrics and (rank 0) the parameters after."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import build_plan, stream_hf_weights
    from model_specs.weights.maps import weight_map_for

    out: dict[str, Any] = {}
    for name, hf_dir, layout, ckpt in cases:
        optimizer = OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0,
                                      use_distributed_optimizer=layout.get("expert", 1) > 1)
        with Actor(hf_dir, ParallelLayout(**layout), micro_batch_size=2, optimizer=optimizer) as actor:
            actor.load_weights(ckpt)
            shard = actor.shard(make_batch())
            old, _ = actor.compute_old_log_probs(shard)
            keep = actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
            out[name] = (shard.global_rows.numpy(), old.numpy()) if keep and shard.global_rows is not None \
                and old is not None else None
            wmap = weight_map_for(actor.spec.hf_config)
            plan = build_plan(actor.chunks, wmap)
            streamed = list(stream_hf_weights(actor.chunks, wmap, plan, bucket_bytes))
            out[f"{name}/stream"] = {k: v for b in streamed for k, v in b} if rank == 0 else None
            shard.old_log_probs = old
            out[f"{name}/step"] = actor.train_step(shard)
            out[f"{name}/after"] = actor.full_state_dict(to_all_ranks=False)
    return out


def moved_by_the_step(hf_dir: Path, after: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per megatron parameter, max |after - before| of a step that started from the HF model's
    weights (`after`: a run_cases case's parameters after its step, every parameter present)."""
    from model_specs import model_spec_for
    from model_specs.weights.maps import weight_map_for

    wmap = weight_map_for(model_spec_for(hf_dir).hf_config)
    hf = load_file(Path(hf_dir) / "model.safetensors")
    before = {m.megatron: wmap.to_megatron(m, [hf[n] for n in m.hf]) for m in wmap.mappings()}
    assert sorted(after) == sorted(before)
    return {k: float((after[k] - t).abs().max()) for k, t in before.items()}


def assert_layout_equals_one_process(ranks: list[dict], case: str, one: dict, name: str,
                                     hf_dir: Path) -> None:
    """Case `case` of a layout run on `ranks` against `name` of the one-process run: log-probs and
    the parameters after the step within TOL, loss and grad norm too, and the sync's stream equal
    to the HF file bit for bit."""
    got = gather_row_values([r[case] for r in ranks], ROWS, SEQ)
    want = gather_row_values([one[name]], ROWS, SEQ)
    err = float((got - want)[valid()].abs().max())
    after, reference = ranks[0][f"{case}/after"], one[f"{name}/after"]
    assert sorted(after) == sorted(reference)
    errs = {k: float((after[k] - reference[k]).abs().max()) for k in reference}
    step_err = max(errs.values())
    print(f"{case}: max |layout - one process| log-prob {err:.3g}, parameter after a GSPO step "
          f"{step_err:.3g}")
    worst = sorted(errs, key=lambda k: errs[k], reverse=True)[:4]
    assert err <= TOL and step_err <= TOL, (case, {k: errs[k] for k in worst})
    original = load_file(Path(hf_dir) / "model.safetensors")
    streamed = ranks[0][f"{case}/stream"]
    assert sorted(streamed) == sorted(original)
    assert all(torch.equal(streamed[k], t) for k, t in original.items()), case
    for key in ("loss", "grad_norm"):
        assert ranks[0][f"{case}/step"][key] == pytest.approx(one[f"{name}/step"][key], rel=TOL, abs=TOL)


def gspo_run_with_replay(model: Path, server_url: str, tmp_path: Path) -> tuple[list, list]:
    """A GSPO run of the main job's task (examples/tiny_moe_larger_digit.yaml, 3 steps) on `model`
    with routing replay (R3) against the SGLang server at `server_url`: asserts exit 0 and 3
    steps; returns train/logprob_abs_diff and routing/replay_mismatch per step."""
    from gspo_megatron.run.metrics import read_jsonl
    from test_trainer_e2e import PROMPTS, run_train

    sets = {"model.hf_path": str(model), "rollout.prompts": str(PROMPTS),
            "rollout.server_urls": f"[{server_url}]", "rollout.group_size": 4,
            "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8, "train.steps": 3,
            "train.mini_batches": 2, "train.micro_batch_size": 4, "train.warm_start_steps": 2,
            "moe.replay": "true", "eval.interval": 0, "checkpoint.dir": str(tmp_path / "ckpt"),
            "checkpoint.export_hf": "null", "logging.tensorboard_dir": str(tmp_path / "tb")}
    args = ["examples/tiny_moe_larger_digit.yaml", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    proc = run_train(args, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True)
    assert len(steps) == 3
    diff = [s["train/logprob_abs_diff"] for s in steps]
    mismatch = [s["routing/replay_mismatch"] for s in steps]
    print(f"train/logprob_abs_diff per step {diff}; routing/replay_mismatch {mismatch}")
    return diff, mismatch
