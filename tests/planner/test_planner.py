"""The layout planner (gspo-megatron plan, gspo_megatron/planner/).

- The memory model's static terms are what built models hold, per rank, on gloo: TP2, PP2, EP2,
  VPP2, DP2 and EP2 with the distributed optimizer, fp32 and bf16: weights exactly, gradients and
  optimizer state within 2% (DDP pads its buckets).
- `plan` on Qwen3-235B-A22B with 64 H100s lists the published TP4 x PP8(first=11,last=11) x EP8
  layout as valid and fitting, and rejects with a reason the layouts that cannot hold the weights.
- Bad input gets one line.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from test_steps_host_syncs import _batch

ROOT = Path(__file__).resolve().parents[2]

LAYOUTS = {  # name: (world, layout, bf16, distributed optimizer); plain TP2 and EP2 are the bf16 TP2's
    # and the EP2 distopt's splits of the weights (the fp32 grads and Adam state are pp2's and vpp2's)
    "pp2": (2, dict(pipeline=2), False, False),
    "vpp2": (2, dict(pipeline=2, virtual_pipeline=2), False, False),
    "dp2_distopt_bf16": (2, {}, True, True),
    "ep2_distopt": (2, dict(expert=2), False, True),
    "tp2_bf16": (2, dict(tensor=2), True, False),
}


def _measured(rank, world, layout_kwargs: dict, bf16: bool, dist_opt: bool):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.check import measured_static
    from gspo_megatron.planner.memory import MemorySettings, static_bytes
    from megatron.core import parallel_state as ps
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    dtype = torch.bfloat16 if bf16 else torch.float32
    layout = ParallelLayout(**layout_kwargs)
    with Actor(tiny_hf_config(), layout, optimizer=OptimizerSettings(optimizer="adam", lr=1e-4,
               use_distributed_optimizer=dist_opt), loss=LossSettings(name="ce"), micro_batch_size=4,
               params_dtype=dtype) as actor:
        actor.train_step(actor.shard(_batch()))  # Adam's state exists after the first step
        weights, grads, opt = measured_static(actor)  # what plan --check measures
        settings = MemorySettings(params_dtype="bfloat16" if bf16 else "float32", use_distributed_optimizer=dist_opt)
        predicted = static_bytes(actor.spec, layout, world, settings, ps.get_pipeline_model_parallel_rank())
    return dict(measured=(weights, grads, opt), predicted=predicted)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_static_memory_is_what_the_built_model_holds(name):
    world, layout, bf16, dist_opt = LAYOUTS[name]
    for rank, r in enumerate(run_distributed(_measured, world, (layout, bf16, dist_opt), timeout=600)):
        (w, g, o), (pw, pg, po) = r["measured"], r["predicted"]
        assert w == pw, (name, rank, "weights", w, pw)
        assert abs(g - pg) <= 0.02 * g, (name, rank, "gradients", g, pg)
        assert abs(o - po) <= 0.02 * o, (name, rank, "optimizer", o, po)


def test_context_parallel_divides_the_optimizer_shard_not_the_weights():
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import MemorySettings, static_bytes
    from model_specs import model_spec_for
    from model_specs.hf.published import QWEN3_30B_A3B
    s = MemorySettings(use_distributed_optimizer=True)
    one = ParallelLayout(tensor=2, expert=8, expert_tensor=1)
    cp2 = ParallelLayout(tensor=2, expert=8, expert_tensor=1, context=2)
    spec = model_spec_for(QWEN3_30B_A3B, params_dtype=torch.bfloat16,
                          overrides=one.transformer_config_fields(is_moe=True))
    w1, g1, o1 = static_bytes(spec, one, 16, s, 0)    # DP8
    w2, g2, o2 = static_bytes(spec, cp2, 16, s, 0)    # DP4 x CP2: the shard over DP x CP = 8
    assert (w1, g1, o1) == (w2, g2, o2)


def test_gpu_kinds_of_the_parser_are_the_planners():
    from gspo_megatron.planner.arguments import GPU_KINDS
    from gspo_megatron.planner.plan import GPUS
    assert tuple(sorted(GPUS)) == GPU_KINDS


def test_memory_strings():
    from gspo_megatron.planner.plan import PlanError, parse_memory
    assert parse_memory("80GiB") == 80 * 2**30 and parse_memory("141GB") == 141 * 10**9
    assert parse_memory("81920 MiB") == 80 * 2**30
    for bad in ("80", "eighty GiB", "80 GiBs", "-1GiB"):
        with pytest.raises(PlanError, match="expected a size such as 80GiB"):
            parse_memory(bad)


def test_budget_that_fits_grows_with_memory_and_shrinks_with_layers_in_flight():
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import GiB, MemorySettings, rank_memory
    from model_specs import model_spec_for
    from model_specs.hf.published import QWEN3_30B_A3B
    layout = ParallelLayout(tensor=2, pipeline=2, expert=8, expert_tensor=1)
    spec = model_spec_for(QWEN3_30B_A3B, params_dtype=torch.bfloat16,
                          overrides=layout.transformer_config_fields(is_moe=True))
    s = MemorySettings(use_distributed_optimizer=True, max_tokens=8192)
    mem = rank_memory(spec, layout, 16, s)
    assert mem.max_tokens_that_fit(80 * GiB) < mem.max_tokens_that_fit(141 * GiB)
    full = rank_memory(spec, layout, 16, MemorySettings(use_distributed_optimizer=True, recompute="full"))
    assert full.activation_bytes_per_token < mem.activation_bytes_per_token / 5
    budget = mem.max_tokens_that_fit(80 * GiB)
    import dataclasses
    at = rank_memory(spec, layout, 16, dataclasses.replace(s, max_tokens=budget))
    over = rank_memory(spec, layout, 16, dataclasses.replace(s, max_tokens=budget + 1024))
    assert at.total() <= 80 * GiB < over.total()


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_plan_qwen3_235b_on_64_h100s_lists_the_published_layout():
    proc = _plan("examples/qwen3_235b_a22b.yaml", "--model", "Qwen3-235B-A22B", "--gpus", "64",
                 "--gpu-memory", "80GiB", "--gpus-per-node", "8", "--all", "--top", "100")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    print(out)
    published = [ln for ln in out.splitlines() if ln.startswith("| TP4xPP8(first=11,last=11)xEP8xETP1xDP2 |")]
    assert published, "the published layout is not in the table"
    assert "fits" in published[0]
    cannot = [ln for ln in out.splitlines() if "weights, gradients and optimizer state" in ln]
    assert cannot, "no layout rejected for its static memory"
    assert any(ln.startswith("| TP1xPP1") for ln in cannot)


def test_plan_deepseek_v3_and_kimi_k2_on_128_h100s_fit_with_the_optimizer_on_the_host():
    """DeepSeek-V3 with Adam holds at least 16 bytes per parameter on the GPUs however it is split
    (bf16 weights, bf16 or fp32 gradients, fp32 moments and main weights): 671e9 x 16 B = 10.7 TB,
    more than 128 x 80 GiB. With the optimizer's state on the host (megatron's offload, as the
    peers train it on 128 H100s) layouts fit: the plan says nothing fits without it, lists those,
    and the host holds 16 B per parameter of a node's shards (under the 2 TB of an H100 node). With
    too little host memory nothing fits at all; 256 GPUs fit without offload."""
    from gspo_megatron.planner.memory import GiB
    common = ("--gpu-memory", "80GiB", "--gpus-per-node", "8", "--top", "200")
    for model, gb_params in (("DeepSeek-V3", 671), ("Kimi-K2", 1027)):
        proc = _plan(*common, "--model", model, "--gpus", "128")  # the default config
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "nothing fits with the optimizer's state on the GPUs" in out
        assert "train.optimizer_cpu_offload: true" in out
        rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| TP") and ln.endswith("| fits |")]
        assert rows, out
        # GiB per node: 16 B x 8 shards of 1/128 of the parameters = about 1 B per parameter
        host = [float(r[-2]) for r in rows]
        assert all(0.9 * gb_params * 1e9 / GiB < h < 2e12 / GiB for h in host), (model, host)
    starved = _plan(*common, "--model", "DeepSeek-V3", "--gpus", "128", "--host-memory", "100GB", "--all")
    assert starved.returncode == 1 and "no layout fits 128 x 80.0 GiB" in starved.stderr, starved.stderr
    rows = [ln for ln in starved.stdout.splitlines() if ln.startswith("| TP")]
    assert rows and all("cannot hold the weights, gradients and optimizer state" in ln for ln in rows)
    big = _plan(*common, "--model", "DeepSeek-V3", "--gpus", "256")
    assert big.returncode == 0, big.stderr
    assert "optimizer offload" not in big.stdout
    assert any(ln.startswith("| TP") and ln.endswith("| fits |") for ln in big.stdout.splitlines())


def test_offload_moves_its_share_of_the_optimizer_to_the_host():
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import HOST_BYTES_PER_OFFLOADED_PARAM, MemorySettings, rank_memory
    from model_specs.hf.published import BY_NAME
    from model_specs.shape import model_shape_for
    spec = model_shape_for(dict(BY_NAME["DeepSeek-V3"]))
    layout = ParallelLayout(tensor=8, pipeline=16, expert=8, expert_tensor=1, last_stage_layers=1)
    on_gpu = rank_memory(spec, layout, 128, MemorySettings(use_distributed_optimizer=True))
    half = rank_memory(spec, layout, 128, MemorySettings(use_distributed_optimizer=True,
                                                          optimizer_offload_fraction=0.5))
    assert on_gpu.host == 0 and on_gpu.offloaded_params == 0
    assert abs(half.optimizer - on_gpu.optimizer / 2) <= 16
    params = on_gpu.optimizer // 12  # Adam: 12 B per parameter of the shard
    assert abs(half.offloaded_params - params / 2) <= 1
    assert half.host == half.offloaded_params * HOST_BYTES_PER_OFFLOADED_PARAM
    assert (half.weights, half.gradients) == (on_gpu.weights, on_gpu.gradients)


def test_plan_gpt_oss_120b_fits_on_32_not_8_and_20b_on_8():
    """gpt-oss-120b (116.8B, the experts dequantized to bf16) with Adam needs about 2.1 TB of
    weights, gradients and optimizer state: not 8 x 80 GiB, 32 of them hold it. gpt-oss-20b fits
    on 8. Every layout has expert-TP 1 (expert biases: model_specs/features/linear_bias/)."""
    common = ("examples/qwen3_235b_a22b.yaml", "--gpu-memory", "80GiB", "--gpus-per-node", "8",
              "--top", "200", "--all")
    small = _plan(*common, "--model", "gpt-oss-120b", "--gpus", "8")
    assert small.returncode == 1 and "no layout fits 8 x 80.0 GiB" in small.stderr, small.stderr
    for model, gpus in (("gpt-oss-120b", "32"), ("gpt-oss-20b", "8")):
        proc = _plan(*common, "--model", model, "--gpus", gpus)
        assert proc.returncode == 0, proc.stderr
        rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| TP")]
        assert any(ln.endswith("| fits |") for ln in rows) and all("xETP1x" in ln for ln in rows)


def test_plan_qwen3_next_80b_fits_on_32_h100s_and_on_16_with_the_optimizer_on_the_host():
    """Qwen3-Next-80B-A3B (79.7B counted) with Adam: about 1.3 TB of weights, gradients and
    optimizer state; 32 x 80 GiB hold it, 16 only with the optimizer's state on the host. Every
    layout's TP divides its 2 query groups and its 16 Gated DeltaNet key heads."""
    common = ("examples/qwen3_235b_a22b.yaml", "--model", "Qwen3-Next-80B-A3B", "--gpu-memory",
              "80GiB", "--gpus-per-node", "8", "--top", "200")
    big = _plan(*common, "--gpus", "32")
    assert big.returncode == 0, big.stderr
    rows = [ln for ln in big.stdout.splitlines() if ln.startswith("| TP")]
    assert any(ln.endswith("| fits |") for ln in rows) and "optimizer offload" not in big.stdout
    assert all(ln.startswith(("| TP1x", "| TP2x")) for ln in rows)
    small = _plan(*common, "--gpus", "16")
    assert small.returncode == 0, small.stderr
    assert "nothing fits with the optimizer's state on the GPUs" in small.stdout


@pytest.mark.parametrize("args, message", [
    (("--gpus", "8", "--gpu-memory", "80 gigs"), "--gpu-memory '80 gigs': expected a size such as 80GiB"),
    (("--gpus", "0"), "--gpus 0: expected >= 1"),
    (("--gpus", "8", "--layout", "tensor=16"), "world size 8 is not divisible by tensor x pipeline"),
    (("--gpus", "8", "--layout", "tensor=two"), "--layout 'tensor=two': expected fields such as"),
    (("--gpus", "8", "--nodes", "3"), "--nodes 3: expected a divisor of --gpus 8"),
    (("--gpus", "8", "--model", "Qwen9-1T"), "--model 'Qwen9-1T': not a published model"),
    (("--gpus", "8", "--model", "Mixtral-8x7B"), "--model 'Mixtral-8x7B': the mixtral family is not "
                                                 "supported yet (supported: deepseek_v3, glm4_moe, "),
    (("--gpus", "8", "--model", "Llama-4-Scout"), "--model 'Llama-4-Scout': the llama4 family is not supported"),
    # counts below 1 are refused where they are read, never planned for or taken as "not given"
    (("--gpus", "8", "--tokens", "-5"), "--tokens -5: expected >= 1"),
    (("--gpus", "8", "--tokens", "0"), "--tokens 0: expected >= 1"),
    (("--gpus", "8", "--step-tokens", "-100"), "--step-tokens -100: expected >= 1"),
    (("--gpus", "8", "--step-tokens", "0"), "--step-tokens 0: expected >= 1"),
    (("--gpus", "8", "--gpus-per-node", "0"), "--gpus-per-node 0: expected >= 1"),
    (("--gpus", "8", "--top", "-1"), "--top -1: expected >= 1"),
    (("--gpus", "12", "--gpus-per-node", "8"), "--gpus 12: expected a multiple of --gpus-per-node 8 (whole "
                                               "nodes, e.g. 8 or 16), or at most 8 on one node"),
    (("--gpus", "16", "--nodes", "4", "--gpus-per-node", "8"),
     "--nodes 4 x --gpus-per-node 8 = 32 GPUs: expected --gpus 16"),
])
def test_bad_input_gets_one_line(args, message):
    model = () if "--model" in args else ("--model", "tiny-qwen3-moe")
    proc = _plan("examples/tiny_moe_larger_digit.yaml", *model, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.slow
def test_check_runs_the_layout_and_prints_predicted_against_measured():
    proc = _plan("examples/tiny_moe_larger_digit.yaml", "--gpus", "2", "--model", "tiny-qwen3-moe",
                 "--layout", "pipeline=2", "--tokens", "256", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln.split("|")[1:-1] for ln in proc.stdout.splitlines() if ln.startswith("| 0 |") or ln.startswith("| 1 |")]
    assert len(rows) == 2, proc.stdout
    for rank, stage, weights, grads, opt, _, _ in rows:
        predicted, measured = (float(x) for x in weights.split("/"))
        assert predicted == measured and measured > 0, (rank, weights)
        for cell in (grads, opt):
            p, m = (float(x) for x in cell.split("/"))
            assert abs(p - m) <= 0.02 * m + 0.01, (rank, cell)
    assert {r[1].strip() for r in rows} == {"0", "1"}  # one rank per pipeline stage



def _check_actor_recompute(rank, world, overrides: list[str]):
    """What plan --check predicts with (settings_from) and what its actor's model runs with."""
    from gspo_megatron.config import load_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.check import build_actor
    from gspo_megatron.planner.command import settings_from
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    cfg = load_config(str(ROOT / "examples/tiny_moe_larger_digit.yaml"), overrides)
    s = settings_from(cfg, 64)
    with build_actor(cfg, tiny_hf_config(), ParallelLayout(), s, 32) as actor:
        model = actor.chunks[0].module.config  # the TransformerConfig the layers were built with
        return dict(predicted=(s.recompute, s.recompute_modules),
                    built=(model.recompute_granularity, model.recompute_method, model.recompute_num_layers,
                           list(model.recompute_modules or [])))


@pytest.mark.parametrize("overrides, predicted, built", [
    (["compute.recompute=full"], ("full", ("core_attn",)), ("full", "uniform", 1)),
    (["compute.recompute=selective", "compute.recompute_modules=[layernorm]"],
     ("selective", ("layernorm",)), ("selective", None, None)),
])
def test_check_measures_the_recompute_it_predicts_with(overrides, predicted, built):
    """plan --check predicts with the config's compute.recompute: its actor must run it, or the
    measured column is another configuration's (the default, no recomputation)."""
    (r,) = run_distributed(_check_actor_recompute, 1, (overrides,), timeout=300)
    assert r["predicted"] == predicted
    assert r["built"][:3] == built, r
    if predicted[0] == "selective":
        assert r["built"][3] == list(predicted[1]), r

def test_without_model_the_config_model_is_named_not_a_flag_never_given():
    """`plan --gpus 8` plans the default config's model.hf_path: an error names that field and its
    file (the user typed no --model), and the published config of the same name."""
    proc = _plan("--gpus", "8")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--model '" not in lines[0], proc.stderr
    assert lines[0].startswith("gspo-megatron: error: model.hf_path='/models/Qwen3-235B-A22B' (of "), lines[0]
    assert "examples/qwen3_235b_a22b.yaml; no --model given): not a published model" in lines[0]
    assert lines[0].endswith("give --model Qwen3-235B-A22B for its published config"), lines[0]


def test_plan_prints_the_parallel_settings_of_its_best_layout(tmp_path):
    """After the table, the `parallel:` section (and the --set overrides) that give the first row:
    in place of the config's own section, or over it, they are that layout."""
    import yaml
    from gspo_megatron.config import load_config
    config = "examples/qwen3_235b_a22b.yaml"  # its own layout sets first/last_stage_layers=11
    proc = _plan(config, "--model", "Qwen3-235B-A22B", "--gpus", "64", "--gpu-memory", "80GiB",
                 "--gpus-per-node", "8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    best = next(ln for ln in out if ln.startswith("| TP")).split(" | ")[0].removeprefix("| ")
    at = out.index(f"the best layout, {best}, in the run config:")
    assert out[at + 1] == "parallel:"
    section = [ln for ln in out[at + 2:at + 12] if ln.startswith("  ")]
    assert len(section) == 8, out[at:]
    sets = out[at + 2 + len(section)]
    assert sets.startswith("or on the command line: --set parallel.tensor="), sets
    data = yaml.safe_load((ROOT / config).read_text())
    data["parallel"] = yaml.safe_load("\n".join(["parallel:", *section]))["parallel"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    layout = load_config(str(tmp_path / "c.yaml"), []).parallel
    assert layout.describe(64) == best
    overrides = [o for o in sets.removeprefix("or on the command line: ").split() if o != "--set"]
    assert load_config(str(ROOT / config), overrides).parallel == layout
