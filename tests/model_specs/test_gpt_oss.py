"""gpt-oss (gpt_oss): the config mapping and what it refuses, the weight map against the HF files
(experts stacked per layer, gate and up interleaved), HF -> megatron -> HF bit-exact (at sizes
drawn at random, and from MXFP4: tests/checkpoint/test_convert_gpt_oss.py), megatron's log-probs
against transformers' on a tiny model, what that match rests on, and (slow) TP2, PP2 and EP2 on
gloo ranks against one process.

The tiny model (tools/make_tiny_model.py, 4 layers) alternates a sliding window of 8 tokens and
full attention, with YaRN x4 over an original context of 8 positions (truncate false), 8 experts
top-4 and a SwiGLU clamp of 0.5; its sinks and every bias are drawn at random. Rows are up to 20
tokens: past the window and past YaRN's original context. One process computes log-probs with the
Actor (fp32), compares them with transformers, streams the weights as the SGLang sync does and
takes one GSPO step; the slow test does the same under each layout on 2 gloo ranks.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from family_checks import (assert_layout_equals_one_process, assert_one_process_equals_transformers,
                           distance_from_transformers, moved_by_the_step, run_cases, zero_params)
from fixtures_models import assert_same_hf_weights
from model_specs import HFConfigError, model_spec_for
from model_specs.shape import model_shape_for
from model_specs.hf.tiny import gpt_oss
from model_specs.weights.maps import weight_map_for
from tools.make_tiny_model import make_tiny_model

NAME = "gpt_oss"
# initializer_range 0.1: attention far from uniform and expert activations past the clamp
MODEL: dict[str, Any] = dict(initializer_range=0.1, num_hidden_layers=4)
# expert_tensor 1: expert biases refuse expert-TP (model_specs/features/linear_bias/). TP2 alone is the layout
# where experts are whole on ranks that split the dense layers, which megatron does not mark as
# experts (actor/weights/full.py is_expert_param)
LAYOUTS = {"tp2": dict(tensor=2, expert_tensor=1), "tp2_ep2": dict(tensor=2, expert=2, expert_tensor=1),
           "pp2": dict(pipeline=2), "ep2": dict(expert=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "hf", seed=5, **MODEL)


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    """The tiny model converted to a megatron checkpoint (tools/convert_hf_to_megatron.py)."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    return convert_hf_to_megatron(tiny, tmp_path_factory.mktemp("gpt_oss_mcore") / "m")


# ---------------------------------------------------------------- config mapping (fast)
def test_maps_sinks_windows_biases_clamp_and_yarn():
    from megatron.core.activations import quick_gelu

    spec = model_spec_for(gpt_oss())
    c = spec.config
    assert c.softmax_type == "learnable" and c.add_bias_linear and c.add_qkv_bias
    assert c.window_size == (7, 0) and c.window_attn_skip_freq == [1, 0, 1, 0]
    assert c.activation_func is quick_gelu and c.gated_linear_unit
    assert (c.glu_linear_offset, c.activation_func_clamp_value) == (1.0, 0.5)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 4, 32)
    assert c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
    assert not c.moe_router_enable_expert_bias and c.moe_layer_freq == [1, 1, 1, 1]
    assert (c.kv_channels, c.num_query_groups) == (16, 2)
    assert spec.position_embedding_type == "yarn" and spec.rotary_base == 150000.0
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings) == (4.0, 8)
    assert c.yarn_correction_range_round_to_int is False  # truncate: false
    assert not spec.transformer_engine
    full = model_spec_for(gpt_oss(layer_types=["full_attention"] * 4, sliding_window=None)).config
    assert full.window_size is None and full.window_attn_skip_freq is None


def test_the_mxfp4_quantization_config_is_accepted_for_gpt_oss_only():
    """The converter dequantizes gpt-oss's MXFP4 experts (gspo_megatron/checkpoint/mxfp4.py)."""
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    assert model_shape_for(gpt_oss(quantization_config=quant)).family == "gpt_oss"
    with pytest.raises(HFConfigError, match=r"quant_method='mxfp4'\) is not supported"):
        model_shape_for({**model_spec_for(gpt_oss()).hf_config, "model_type": "qwen3_moe",
                         "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 32,
                         "quantization_config": quant})


@pytest.mark.parametrize("change, match", [
    (dict(attention_bias=False), "attention_bias=false is not supported"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported"),
    (dict(swiglu_limit=0), "swiglu_limit=0, expected a number > 0"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2),
     "layer_types=.* is not supported"),
    (dict(layer_types=["full_attention"] * 3), "layer_types=.* is not supported: expected 4"),
    (dict(sliding_window=None), "lacks required field 'sliding_window'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "rope_type='llama3' is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), r"quant_method='fp8'\) is not supported"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9, expected 1..8"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok=1 with the softmax taken over the top-k"),
])
def test_what_megatron_would_compute_differently_is_refused_by_name(change, match):
    """The trainer (model spec) and the planner (torch-free shape) refuse with the same line."""
    config = gpt_oss(**change)
    with pytest.raises(HFConfigError, match=match) as by_spec:
        model_spec_for(config)
    with pytest.raises(HFConfigError) as by_shape:
        model_shape_for(config)
    assert str(by_shape.value) == str(by_spec.value)
    assert "\n" not in str(by_spec.value)


def test_expert_tensor_parallelism_and_transformer_engine_are_refused():
    with pytest.raises(HFConfigError, match="expert_tensor_parallel_size=2 with expert biases"):
        model_spec_for(gpt_oss(), overrides=dict(tensor_model_parallel_size=2,
                                                 sequence_parallel=True))
    model_spec_for(gpt_oss(), overrides=dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                             expert_tensor_parallel_size=1))
    with pytest.raises(HFConfigError, match="attention sinks with Transformer Engine"):
        model_spec_for(gpt_oss(), transformer_engine=True)


def test_megatron_still_refuses_expert_biases_with_expert_tensor_parallelism():
    """What the expert-TP refusal rests on (model_specs/features/linear_bias/): megatron asserts ETP == 1 for
    MoE with biases (TransformerConfig.__post_init__), and its expert MLP still adds the fc2 bias to
    each expert-TP rank's partial sum (mlp.py). When megatron lifts either, this fails and the
    refusal in model_specs/build.py can be revisited."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP

    with pytest.raises(AssertionError, match="Bias in Moe is only supported when ETP==1"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
                          add_bias_linear=True, tensor_model_parallel_size=2,
                          expert_tensor_parallel_size=2, sequence_parallel=True)
    assert "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)" in \
        inspect.getsource(MLP.forward)


def test_megatron_still_reduces_a_lone_experts_fc2_over_a_group_of_one():
    """What model_specs.features.linear_bias.layers.ExpertRowParallelLinear adds: without expert parallelism or expert-TP,
    megatron's expert fc2 goes through the TP reduction (which returns its input as is) and the
    expert MLP then adds its bias in place, which autograd refuses. When megatron changes either,
    this fails and the adaptation can be revisited."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    assert "self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)" \
        in inspect.getsource(RowParallelLinear.__init__)


def test_megatron_still_sums_an_expert_biases_gradient_over_the_tp_group():
    """What ExpertRowParallelLinear's marks rest on (model_specs/features/linear_bias/layers.py): megatron marks an expert
    fc2's bias sequence-parallel like any row-parallel bias, and sums marked gradients over the
    (dense) TP group, which mixed other ranks' experts into it under TP2 x EP2; and its grad norm
    counts a parameter not marked TP-split on TP rank 0 only."""
    import importlib

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    assert 'setattr(self.bias, "sequence_parallel", self.sequence_parallel)' in \
        inspect.getsource(RowParallelLinear.__init__)
    assert 'getattr(param, "sequence_parallel", False)' in inspect.getsource(finalize)
    # and a parameter not marked TP-split counts in the grad norm on TP rank 0 only
    assert "return tp_group.rank() == 0" in \
        inspect.getsource(tensor_parallel.param_is_not_tensor_parallel_duplicate)


def test_megatron_still_leaves_the_sinks_tp_split_unmarked():
    """What SinkDotProductAttention adds (model_specs/features/sinks/layers.py): the learnable softmax offset is
    split over TP ranks by heads, and megatron marks it nowhere but in its sharded state dict."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    source = inspect.getsource(DotProductAttention.__init__)
    assert "num_attention_heads_per_partition" in source
    assert "set_tensor_model_parallel_attributes" not in source


# ---------------------------------------------------------------- weight map and conversion
def test_weight_map_covers_every_hf_tensor_with_its_shape(tiny):
    hf = load_file(tiny / "model.safetensors")
    wmap = weight_map_for(model_spec_for(tiny).hf_config)
    assert sorted(set(wmap.hf_names())) == sorted(hf)
    by = wmap.by_megatron_name()
    fc1 = by["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.1.mlp.experts.gate_up_proj",) and fc1.stacked
    assert by["decoder.layers.3.self_attention.core_attention.softmax_offset"].hf == \
        ("model.layers.3.self_attn.sinks",)
    # gate and up interleaved in HF, [gate; up] in megatron
    stack = hf["model.layers.1.mlp.experts.gate_up_proj"]                     # [E, h, 2f]
    got = wmap.to_megatron(fc1, [stack])                                      # [2f, h]
    assert torch.equal(got[:32], stack[5][:, 0::2].T) and torch.equal(got[32:], stack[5][:, 1::2].T)
    for m in wmap.mappings():
        assert [tuple(hf[n].shape) for n in m.hf] == wmap.hf_shapes(m, wmap.to_megatron(
            m, [hf[n] for n in m.hf]).shape), m.megatron
    assert all(hf[k].abs().max() > 0 for k in hf if k.endswith(("bias", "sinks")))


def test_hf_megatron_hf_is_bit_exact(tiny, ckpt, tmp_path):
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    out = convert_megatron_to_hf(ckpt, tmp_path / "back", batch_bytes=4096)  # stacks cut by batch
    assert_same_hf_weights(tiny, out)


# ---------------------------------------------------------------- log-probs


@pytest.fixture(scope="module")
def one_process(tiny, ckpt):
    return run_distributed(run_cases, 1, ([(NAME, str(tiny), {}, str(ckpt))],), timeout=600)[0]


def test_one_process_log_probs_equal_transformers(tiny, one_process):
    assert_one_process_equals_transformers(one_process, NAME, tiny)


def _no_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: a softmax without the sink


def _no_glu_offset(model):
    for layer in model.model.layers:
        experts = layer.mlp.experts
        limit, alpha = experts.limit, experts.alpha

        def gate(gate_up, limit=limit, alpha=alpha):
            g, u = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
            return u * g * torch.sigmoid(g * alpha)
        experts._apply_gate = gate


CONTROLS = {
    "no_sinks": dict(edit_model=_no_sinks),
    "no_sliding_window": dict(layer_types=["full_attention"] * 4),
    "no_yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
    "no_clamp": dict(swiglu_limit=1e9),
    "no_glu_offset": dict(edit_model=_no_glu_offset),
    "no_attention_biases": dict(edit_model=zero_params(("q_proj.bias", "k_proj.bias",
                                                         "v_proj.bias", "o_proj.bias"))),
    "no_router_bias": dict(edit_model=zero_params(("router.bias",))),
    "no_expert_biases": dict(edit_model=zero_params(("gate_up_proj_bias", "down_proj_bias"))),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_what_the_match_rests_on(tiny, one_process, control):
    """transformers without one of gpt-oss's features is far from megatron's answer, so the 1e-5
    match shows megatron computes each of them."""
    diff = distance_from_transformers(one_process, NAME, tiny, **CONTROLS[control])
    print(f"gpt_oss against transformers {control}: {diff:.3g}")
    assert diff > 1e-3


def test_a_gspo_step_trains_sinks_biases_and_experts(tiny, one_process):
    moved = moved_by_the_step(tiny, one_process[f"{NAME}/after"])
    for k, m in moved.items():
        if k.endswith(("softmax_offset", "bias")) or ".router." in k or ".self_attention." in k:
            assert m > 0.0, k
    assert max(moved.values()) > 1e-3  # a wrong gradient scale in a layout shows beyond 1e-5


@pytest.mark.slow
def test_layouts_on_two_ranks_equal_one_process(tiny, ckpt, one_process):
    """TP2 (sequence parallel; heads, their sinks and q/k/v biases split; every expert whole on
    both ranks), TP2 x EP2 (half the experts on each rank), PP2 (2 + 2 layers: a windowed and a
    full one each) and EP2 x DP2 (experts across ranks, distributed optimizer), one after another
    on the same 2 gloo ranks: the one-process log-probs, the sync streams every HF tensor
    bit-exactly, and a GSPO step leaves the one-process parameters."""
    cases = [(f"{NAME}/{lay}", str(tiny), layout, str(ckpt)) for lay, layout in LAYOUTS.items()]
    ranks = run_distributed(run_cases, 2, (cases, 1 << 12), timeout=600)
    for case, *_ in cases:
        assert_layout_equals_one_process(ranks, case, one_process, NAME, tiny)


@pytest.mark.parametrize("profile", ["cpu", "cuda", "cuda+te", "cuda+te+apex"])
def test_each_machine_profile_resolves_to_the_local_spec_or_names_the_setting(profile):
    """What a run's default compute settings give gpt-oss on each machine (the actor's own
    spec_for_layout, megatron's TransformerConfig checks included): the local spec without TE;
    with TE (a GPU node's default) the one line naming compute.transformer_engine: false, with
    which the local spec is built. The bias-activation fusion that CUDA's defaults turn on is off
    (model_specs/build.py): left on, every CUDA profile failed in TransformerConfig."""
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.actor.settings import ComputeSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from test_settings_machine_profiles import PROFILES

    available = PROFILES[profile]
    if not available.transformer_engine:
        spec = spec_for_layout(gpt_oss(), ParallelLayout(), available=available)
        assert not spec.transformer_engine and not spec.config.bias_activation_fusion
        return
    with pytest.raises(HFConfigError, match="compute.transformer_engine: false"):
        spec_for_layout(gpt_oss(), ParallelLayout(), available=available)
    # the RoPE and permute fusions that the TE profiles turn on import TE in TransformerConfig,
    # which is not installed here
    spec = spec_for_layout(gpt_oss(), ParallelLayout(), available=available,
                           compute=ComputeSettings(transformer_engine=False),
                           overrides={"apply_rope_fusion": False, "moe_permute_fusion": False})
    assert not spec.transformer_engine and not spec.config.bias_activation_fusion
