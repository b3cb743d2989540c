"""Uneven pipeline stages (parallel.first_stage_layers / last_stage_layers, megatron-core's
num_layers_in_first/last_pipeline_stage): a model whose layers do not divide the pipeline, e.g.
Qwen3-235B-A22B's 94 layers over PP8 or PP4 x VPP2.

Fast: the split is megatron-core's (its TransformerConfig checks, get_num_layers_to_build and
get_transformer_layer_offset, compared over a sweep of sizes), impossible splits are LayoutErrors
naming the numbers, and Qwen3-235B-A22B's layouts validate on a realistic world and build their
TransformerConfig and layer specs. Slow (real gloo process groups): log-probs and GSPO steps under
PP2 (3 + 1 layers) and PP2 x VPP2 (1|2 + 1|2 of 6 layers) equal one process within 1e-5.
Checkpoints, resharding, export and the weight stream: test_model_io_uneven_reshard.py.
"""
from __future__ import annotations

import itertools

import pytest
import test_actor_layouts as actor_layouts
import torch

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout

MODEL = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=512, num_experts=4)
QWEN3_235B_DIMS = dict(num_layers=94, num_attention_heads=64, num_query_groups=4, vocab_size=151936,
                       num_experts=128)


# --- fast: the rules -------------------------------------------------------------------------
@pytest.mark.parametrize("layout, num_layers, message", [
    (dict(pipeline=2, first_stage_layers=0), 4, r"parallel.first_stage_layers must be >= 1, got 0"),
    (dict(pipeline=2, last_stage_layers=-1), 4, r"parallel.last_stage_layers must be >= 1, got -1"),
    (dict(first_stage_layers=4), 4, r"first_stage_layers=4 needs pipeline > 1, got pipeline=1"),
    (dict(pipeline=2, first_stage_layers=4), 4,
     r"first_stage_layers 4 layers leave no layer of num_layers 4 for the 1 middle stage\(s\) "
     r"of pipeline 2"),
    (dict(pipeline=3, first_stage_layers=2, last_stage_layers=2), 4,
     r"first_stage_layers 2 \+ last_stage_layers 2 = 4 layers leave no layer of num_layers 4 for "
     r"the 1 middle stage\(s\) of pipeline 3"),
    (dict(pipeline=2, first_stage_layers=3, last_stage_layers=2), 4,
     r"first_stage_layers 3 \+ last_stage_layers 2 = 5 layers exceed num_layers 4"),
    (dict(pipeline=3, last_stage_layers=5), 4, r"last_stage_layers 5 layers exceed num_layers 4"),
    (dict(pipeline=2, first_stage_layers=2, last_stage_layers=1), 4,
     r"first_stage_layers 2 \+ last_stage_layers 1 = 3 layers leave 1 of num_layers 4 but "
     r"pipeline 2 has no middle stage: the stages must add up to 4"),
    (dict(pipeline=4, first_stage_layers=2), 4,
     r"num_layers 4 - first_stage_layers 2 = 2 middle layers are not divisible by middle stages x "
     r"virtual_pipeline = 3 x 1 = 3"),
    (dict(pipeline=4, first_stage_layers=1, last_stage_layers=1), 5,
     r"num_layers 5 - first_stage_layers 1 - last_stage_layers 1 = 3 middle layers are not "
     r"divisible by middle stages x virtual_pipeline = 2 x 1 = 2"),
    (dict(pipeline=2, virtual_pipeline=2, first_stage_layers=3), 8,
     r"first_stage_layers=3 is not divisible by virtual_pipeline 2"),
    (dict(pipeline=3, virtual_pipeline=2, last_stage_layers=2), 8,
     r"num_layers 8 - last_stage_layers 2 = 6 middle layers are not divisible by middle stages x "
     r"virtual_pipeline = 2 x 2 = 4"),
    (dict(pipeline=2, virtual_pipeline=2, first_stage_layers=2, last_stage_layers=4), 6,
     r"first_stage_layers=2 and last_stage_layers=4 with virtual_pipeline=2 need pipeline > 2"),
    (dict(pipeline=8), 94,
     r"num_layers 94 is not divisible by pipeline x virtual_pipeline = 8 x 1 = 8"),
])
def test_impossible_uneven_splits_name_the_numbers(layout, num_layers, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**layout).validate(layout.get("pipeline", 1),
                                          **{**MODEL, "num_layers": num_layers})


def _megatron_split(num_layers, pp, vpp, first, last):
    """megatron-core's own answer: [virtual stage][pp rank] -> (offset, layers), or None where
    megatron rejects the split (its TransformerConfig checks, or building a stage would fail or
    give a stage no layers / layers that do not tile the model)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2,
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        vp_stages = [v if vpp > 1 else None for v in range(vpp)]
        grid = [[(get_transformer_layer_offset(config, vp_stage=v, pp_rank=r),
                  get_num_layers_to_build(config, vp_stage=v, pp_rank=r)) for r in range(pp)]
                for v in vp_stages]
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    layers = [i for row in grid for offset, n in row for i in range(offset, offset + n)]
    if any(n < 1 for row in grid for _, n in row) or layers != list(range(num_layers)):
        return None
    return grid


@pytest.mark.mcore019
def test_split_is_megatrons():
    """Which layouts pass and which layers each (virtual) stage holds: exactly megatron-core's."""
    checked = accepted = 0
    for num_layers, pp, vpp in itertools.product(range(1, 13), range(2, 5), range(1, 4)):
        for first, last in itertools.product([None, *range(0, 7)], repeat=2):
            layout = ParallelLayout(pipeline=pp, virtual_pipeline=vpp, first_stage_layers=first,
                                    last_stage_layers=last)
            try:
                mine = [[(r.start, len(r)) for r in row]
                        for row in layout.virtual_stage_layers(num_layers)]
            except LayoutError:
                mine = None
            assert mine == _megatron_split(num_layers, pp, vpp, first, last), \
                (num_layers, pp, vpp, first, last)
            if mine is not None:
                assert layout.stage_layers(num_layers) == [
                    sum(len(row[r]) for row in layout.virtual_stage_layers(num_layers))
                    for r in range(pp)]
            checked, accepted = checked + 1, accepted + (mine is not None)
    assert checked == 12 * 3 * 3 * 8 * 8 and 300 < accepted < checked
    # Deliberately stricter than megatron: with pipeline=1 it accepts first/last = num_layers (a
    # no-op) and builds the last_stage_layers otherwise.
    with pytest.raises(LayoutError, match="needs pipeline > 1"):
        ParallelLayout(last_stage_layers=4).validate_layers(4)


def test_uneven_layout_reaches_the_transformer_config_and_describe():
    from gspo_megatron.actor.build import spec_for_layout
    from model_specs.hf.tiny import qwen3_moe

    layout = ParallelLayout(pipeline=2, first_stage_layers=3)
    layout.validate(2, **MODEL)
    assert layout.stage_layers(4) == [3, 1]
    assert layout.describe(2) == "TP1xPP2(first=3)xEP1xETP1xDP1"
    c = spec_for_layout(qwen3_moe(), layout).config
    assert (c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage) == (3, None)
    both = ParallelLayout(pipeline=4, virtual_pipeline=2, first_stage_layers=2, last_stage_layers=4)
    assert both.describe(8) == "TP1xPP4(first=2,last=4)xVPP2xEP1xETP1xDP2"
    assert both.stage_layers(14) == [2, 4, 4, 4]
    assert [[list(r) for r in row] for row in both.virtual_stage_layers(14)] == [
        [[0], [1, 2], [3, 4], [5, 6]], [[7], [8, 9], [10, 11], [12, 13]]]
    fields = both.transformer_config_fields(is_moe=True)
    assert fields["num_layers_in_first_pipeline_stage"] == 2
    assert fields["num_layers_in_last_pipeline_stage"] == 4
    even = ParallelLayout(pipeline=2).transformer_config_fields(is_moe=True)
    assert even["num_layers_in_first_pipeline_stage"] is None
    assert even["num_layers_in_last_pipeline_stage"] is None


def test_a_spec_of_another_split_is_refused():
    """build_model_chunks refuses a ModelSpec whose stage split is not the layout's (the layers
    each stage builds, hence every global name, would differ); checked before any model exists."""
    from gspo_megatron.actor.build import _check_config_matches_layout, spec_for_layout
    from model_specs.hf.tiny import qwen3_moe

    even = spec_for_layout(qwen3_moe(), ParallelLayout(pipeline=2))
    with pytest.raises(ValueError, match="ModelSpec was built for another layout.*"
                                         "num_layers_in_first_pipeline_stage"):
        _check_config_matches_layout(even, ParallelLayout(pipeline=2, first_stage_layers=3))
    uneven = spec_for_layout(qwen3_moe(),
                             ParallelLayout(pipeline=2, last_stage_layers=3))
    with pytest.raises(ValueError, match="ModelSpec was built for another layout"):
        _check_config_matches_layout(uneven, ParallelLayout(pipeline=2))
    interleaved = spec_for_layout(qwen3_moe(),
                                  ParallelLayout(pipeline=2, virtual_pipeline=2))
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size"):
        _check_config_matches_layout(interleaved, ParallelLayout(pipeline=2))
    _check_config_matches_layout(uneven, ParallelLayout(pipeline=2, last_stage_layers=3))


def test_run_config_takes_the_fields():
    from gspo_megatron.config import config_from_dict, describe_fields

    cfg = config_from_dict({"model": {"hf_path": "m"}, "rollout": {"prompts": "p"}},
                           ["parallel.pipeline=8", "parallel.first_stage_layers=11",
                            "parallel.last_stage_layers=11"])
    assert cfg.parallel == ParallelLayout(pipeline=8, first_stage_layers=11, last_stage_layers=11)
    cfg.parallel.validate(64, **QWEN3_235B_DIMS)
    text = describe_fields()
    assert "first_stage_layers: None  # (int | null) Transformer layers on the first" in text
    assert "last_stage_layers: None  # (int | null)" in text


def test_checkpoint_layout_check_names_the_uneven_split(tmp_path):
    """check_layout_fits (before a checkpoint is loaded under a layout) applies the same rules."""
    import json

    from gspo_megatron.checkpoint import CheckpointMismatchError, check_layout_fits
    from model_specs.hf.tiny import qwen3_moe

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(qwen3_moe()))
    check_layout_fits(tmp_path, ParallelLayout(pipeline=2, first_stage_layers=3), 2)
    with pytest.raises(CheckpointMismatchError,
                       match=r"cannot be resharded to TP1xPP3\(first=1\)xEP1xETP1xDP1: num_layers 4 "
                             r"- first_stage_layers 1 = 3 middle layers are not divisible"):
        check_layout_fits(tmp_path, ParallelLayout(pipeline=3, first_stage_layers=1), 3)


# --- fast: Qwen3-235B-A22B (94 layers) -----------------------------------------------------------
# TP4 x PP8 x EP8 with expert-TP 1: world % (TP x PP = 32) and world % (ETP x EP x PP = 64), so 64
# ranks (8 nodes x 8 GPUs) = DP2, expert-DP 1. TP4 x PP4 x VPP2 x EP8 x ETP1: 32 ranks = DP2.
QWEN3_235B_LAYOUTS = {
    "pp8": (dict(tensor=4, pipeline=8, expert=8, expert_tensor=1, first_stage_layers=11,
                 last_stage_layers=11), 64, [11, 12, 12, 12, 12, 12, 12, 11], 2),
    "pp4_vpp2": (dict(tensor=4, pipeline=4, virtual_pipeline=2, expert=8, expert_tensor=1,
                      last_stage_layers=22), 32, [24, 24, 24, 22], 2),
}


@pytest.mark.mcore019
@pytest.mark.parametrize("name", sorted(QWEN3_235B_LAYOUTS))
def test_qwen3_235b_lays_out_unevenly(name):
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from test_published import QWEN3_235B_A22B

    from gspo_megatron.actor.build import spec_for_layout
    from model_specs import model_dims_for, model_spec_for

    kwargs, world, stages, dp = QWEN3_235B_LAYOUTS[name]
    layout = ParallelLayout(**kwargs)
    dims = model_dims_for(QWEN3_235B_A22B)
    assert dims == QWEN3_235B_DIMS
    layout.validate(world, **dims)
    assert layout.data_parallel(world) == dp and layout.stage_layers(94) == stages
    with pytest.raises(LayoutError, match=f"world size {world // 2} is not divisible"):
        layout.validate(world // 2, **dims)
    even = ParallelLayout(**{**kwargs, "first_stage_layers": None, "last_stage_layers": None})
    with pytest.raises(LayoutError, match="num_layers 94 is not divisible by pipeline x virtual"):
        even.validate(world, **dims)

    spec = model_spec_for(QWEN3_235B_A22B, params_dtype=torch.bfloat16,
                          overrides=layout.transformer_config_fields(is_moe=True))
    c = spec.config
    assert (c.num_layers, c.num_moe_experts, c.moe_router_topk, c.hidden_size) == (94, 128, 8, 4096)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (64, 4, 128)
    assert c.moe_ffn_hidden_size == 1536 and spec.vocab_size == 151936
    assert (c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage) == (
        kwargs.get("first_stage_layers"), kwargs.get("last_stage_layers"))
    assert c.sequence_parallel and c.expert_tensor_parallel_size == 1
    # The layer specs megatron builds for each (virtual) stage: the counts of the split.
    vpp = layout.vpp
    for v, row in enumerate(layout.virtual_stage_layers(94)):
        for rank, layers in enumerate(row):
            block = spec.block_spec(v if vpp > 1 else None, pp_rank=rank)
            assert len(block.layer_specs) == len(layers), (v, rank)
    offsets = [[get_transformer_layer_offset(c, vp_stage=v if vpp > 1 else None, pp_rank=r)
                for r in range(layout.pipeline)] for v in range(vpp)]
    assert offsets == [[r.start for r in row] for row in layout.virtual_stage_layers(94)]
    # The trainer's path (spec_for_layout: the layout's fields + the CPU adaptations) builds it too.
    trainer_config = spec_for_layout(QWEN3_235B_A22B, layout, params_dtype=torch.bfloat16).config
    assert (trainer_config.num_layers_in_first_pipeline_stage,
            trainer_config.num_layers_in_last_pipeline_stage,
            trainer_config.virtual_pipeline_model_parallel_size) == (
        kwargs.get("first_stage_layers"), kwargs.get("last_stage_layers"),
        kwargs.get("virtual_pipeline"))


# --- slow: the actor on real gloo process groups ------------------------------------------------
# test_actor_layouts' harness: the same rollout batch, Adam with eps 10 (a wrong loss scale shows),
# log-probs and the parameters after each of two GSPO steps against one process within 1e-5.


def _run_six_layers(rank, world, layout_kwargs, options, init_state):
    """actor_layouts._run on a 6-layer tiny Qwen3-MoE (4 layers admit no uneven PP2 x VPP2)."""
    from model_specs.hf import tiny

    qwen3_moe = tiny.qwen3_moe
    tiny.qwen3_moe = lambda **kw: qwen3_moe(**{"num_hidden_layers": 6, **kw})
    return actor_layouts._run(rank, world, layout_kwargs, options, init_state)


@pytest.fixture(scope="module")
def reference4():
    from distributed import run_distributed

    return run_distributed(actor_layouts._run, 1, ({}, {"micro_batch_size": 64}, None),
                           timeout=180)[0]


@pytest.fixture(scope="module")
def reference6():
    from distributed import run_distributed

    return run_distributed(_run_six_layers, 1, ({}, {"micro_batch_size": 64}, None), timeout=180)[0]


@pytest.mark.slow
@pytest.mark.mcore019
def test_logprobs_and_gspo_steps_pp2_first3(reference4):
    actor_layouts._check_layout(reference4, 2, dict(pipeline=2, first_stage_layers=3))


@pytest.mark.slow
@pytest.mark.mcore019
def test_logprobs_and_gspo_steps_pp2_vpp2_uneven(reference6, monkeypatch):
    # Stages 2 + 4 layers, virtual stages [0] [1, 2] | [3] [4, 5].
    monkeypatch.setattr(actor_layouts, "_run", _run_six_layers)
    results = actor_layouts._check_layout(reference6, 2, dict(pipeline=2, virtual_pipeline=2,
                                                              first_stage_layers=2))
    layers = {int(k.split(".")[2]) for k in results[0]["states"][0]
              if k.startswith("decoder.layers.")}
    assert layers == set(range(6))
