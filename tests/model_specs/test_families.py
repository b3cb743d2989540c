"""Qwen2-MoE and GLM-4.5 (glm4_moe): the config mapping, the weight map against the HF files,
HF -> megatron -> HF bit-exact, and megatron's log-probs against transformers on tiny models.

The tiny models (tools/make_tiny_model.py, 4 layers here) exercise what the families add: a gated
shared expert and full-softmax routing weights (Qwen2-MoE); a dense first layer, a random
e_score_correction_bias that shifts the expert choice, 2 expert groups of which 1 is chosen,
routed_scaling_factor 2.5, an ungated shared expert, QK-norm, q/k/v bias and half-rotary heads
(GLM-4.5). One process computes log-probs with the Actor (fp32), compares them with transformers,
streams the weights as the SGLang sync does and takes one GSPO step; the slow tests do the same
under TP2 and EP2 on 2 gloo ranks and compare with the one process.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from family_checks import (assert_layout_equals_one_process, assert_one_process_equals_transformers,
                           distance_from_transformers, moved_by_the_step, run_cases)
from fixtures_models import assert_same_hf_weights
from model_specs import HFConfigError, model_spec_for
from model_specs.hf.tiny import glm4_moe, qwen2_moe
from model_specs.weights.maps import weight_map_for
from tools.make_tiny_model import make_tiny_model

ARCHS = ("qwen2_moe", "glm4_moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(arch, root / arch, seed=11, num_hidden_layers=4) for arch in ARCHS}


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny models converted to megatron checkpoints (tools/convert_hf_to_megatron.py)."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("mcore")
    return {arch: convert_hf_to_megatron(tiny[arch], root / arch) for arch in ARCHS}


# ---------------------------------------------------------------- config mapping (fast)
def test_qwen2_moe_maps_shared_expert_gate_and_bias():
    c = model_spec_for(qwen2_moe(mlp_only_layers=[2])).config
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 32)
    assert c.moe_shared_expert_intermediate_size == 64 and c.moe_shared_expert_gate
    assert c.moe_layer_freq == [1, 1, 0, 1] and c.ffn_hidden_size == 128
    assert c.moe_router_score_function == "softmax" and c.moe_router_pre_softmax  # norm_topk false
    assert c.add_qkv_bias and not c.qk_layernorm and not c.moe_router_enable_expert_bias
    assert not model_spec_for(qwen2_moe(qkv_bias=False)).config.add_qkv_bias


def test_glm4_moe_maps_router_groups_dense_layers_and_partial_rope():
    spec = model_spec_for(glm4_moe())
    c = spec.config
    assert c.moe_layer_freq == [0, 1, 1, 1] and c.num_moe_experts == 8
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_bias_update_rate == 0.0  # the pretrained bias stays as it is
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (2, 1)
    assert c.moe_router_topk_scaling_factor == 2.5 and c.moe_router_dtype == "fp32"
    assert c.moe_shared_expert_intermediate_size == 32 and not c.moe_shared_expert_gate
    assert c.qk_layernorm and c.add_qkv_bias and c.kv_channels == 16
    assert spec.rotary_percent == 0.5 and spec.gpt_model_kwargs()["rotary_percent"] == 0.5
    plain = model_spec_for(glm4_moe(n_group=1, use_qk_norm=False)).config
    assert plain.moe_router_num_groups is None and not plain.qk_layernorm
    two = model_spec_for(glm4_moe(n_shared_experts=2)).config
    assert two.moe_shared_expert_intermediate_size == 64


@pytest.mark.parametrize("field,value,match", [
    ("norm_topk_prob", False, "norm_topk_prob=false is not supported"),
    ("num_experts_per_tok", 1, "num_experts_per_tok=1 is not supported"),
    ("topk_group", 2, "HF scores a group by its top-2 experts"),  # top-2 of 2 groups: 2 // 2 = 1
    ("n_shared_experts", 0, "n_shared_experts=0 is not supported"),
    ("n_group", 3, "n_group=3, topk_group=1 do not fit num_experts=8"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     "YaRN with partial_rotary_factor=0.5 is not supported"),
])
def test_glm4_moe_what_megatron_cannot_express_is_named(field, value, match):
    with pytest.raises(HFConfigError, match=match):
        model_spec_for(glm4_moe(**{field: value}))


def test_other_unsupported_configs_are_named():
    with pytest.raises(HFConfigError, match="use_sliding_window=true"):
        model_spec_for(qwen2_moe(use_sliding_window=True, sliding_window=4096))
    with pytest.raises(HFConfigError, match="lacks required field 'shared_expert_intermediate_size'"):
        cfg = qwen2_moe()
        del cfg["shared_expert_intermediate_size"]
        model_spec_for(cfg)
    with pytest.raises(HFConfigError, match="partial_rotary_factor=0.5, but the qwen2_moe model"):
        model_spec_for(qwen2_moe(partial_rotary_factor=0.5))
    with pytest.raises(HFConfigError, match="num_experts_per_tok=9, expected 1..8"):
        model_spec_for(glm4_moe(num_experts_per_tok=9))


def test_expert_bias_is_a_frozen_fp32_parameter_that_survives_a_bf16_cast():
    from gspo_megatron.checkpoint.convert import single_process_megatron
    from gspo_megatron.parallel.cpu_compat import apply
    from megatron.core.models.gpt import GPTModel
    from model_specs.features.sigmoid_router.layers import ExpertBiasRouter

    apply()
    spec = model_spec_for(glm4_moe(num_hidden_layers=2), params_dtype=torch.bfloat16,
                          overrides=dict(use_cpu_initialization=True,
                                         moe_token_dispatcher_type="allgather"),
                          transformer_engine=False)
    with single_process_megatron():
        model = GPTModel(spec.config, spec.block_spec(None), **spec.gpt_model_kwargs()).bfloat16()
        router = model.decoder.layers[1].mlp.router
        assert isinstance(router, ExpertBiasRouter)
        params = dict(model.named_parameters())
        bias = params["decoder.layers.1.mlp.router.expert_bias"]
        assert bias.dtype == torch.float32 and not bias.requires_grad and bias is router.expert_bias
        assert params["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
        assert "decoder.layers.1.mlp.router.expert_bias" in model.sharded_state_dict()


# ---------------------------------------------------------------- weight map and conversion
@pytest.mark.parametrize("arch", ARCHS)
def test_weight_map_covers_every_hf_tensor_with_its_shape(tiny, arch):
    hf = load_file(tiny[arch] / "model.safetensors")
    wmap = weight_map_for(model_spec_for(tiny[arch]).hf_config)
    assert sorted(wmap.hf_names()) == sorted(hf)
    by = wmap.by_megatron_name()
    if arch == "qwen2_moe":
        assert by["decoder.layers.0.mlp.shared_experts.gate_weight"].hf == \
            ("model.layers.0.mlp.shared_expert_gate.weight",)
        assert by["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].hf[1] == \
            "model.layers.0.mlp.shared_expert.up_proj.weight"
    else:
        assert by["decoder.layers.1.mlp.router.expert_bias"].hf == \
            ("model.layers.1.mlp.gate.e_score_correction_bias",)
        assert by["decoder.layers.3.mlp.shared_experts.linear_fc2.weight"].hf == \
            ("model.layers.3.mlp.shared_experts.down_proj.weight",)
        assert "decoder.layers.0.mlp.router.weight" not in by  # first_k_dense_replace=1
        assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0


def test_glm4_moe_mtp_layers_of_published_checkpoints_are_ignored():
    wmap = weight_map_for(glm4_moe(num_nextn_predict_layers=1))
    assert wmap.ignores_hf("model.layers.4.eh_proj.weight")
    assert wmap.ignores_hf("model.layers.4.mlp.experts.0.up_proj.weight")
    assert not wmap.ignores_hf("model.layers.3.mlp.gate.weight")
    assert not wmap.ignores_hf("model.layers.5.mlp.gate.weight")
    assert wmap.ignores_hf("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_is_bit_exact(tiny, ckpts, tmp_path, arch):
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    assert_same_hf_weights(tiny[arch], convert_megatron_to_hf(ckpts[arch], tmp_path / "hf"), arch)


# ---------------------------------------------------------------- log-probs


@pytest.fixture(scope="module")
def one_process(tiny, ckpts):
    cases = [(arch, str(tiny[arch]), {}, str(ckpts[arch])) for arch in ARCHS]
    return run_distributed(run_cases, 1, (cases,), timeout=600)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_one_process_log_probs_equal_transformers(tiny, one_process, arch):
    assert_one_process_equals_transformers(one_process, arch, tiny[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gspo_step_trains_everything_but_the_expert_bias(tiny, one_process, arch):
    moved = moved_by_the_step(tiny[arch], one_process[f"{arch}/after"])
    for name, m in moved.items():
        if name.endswith("expert_bias"):
            assert m == 0.0, name  # moe_router_bias_update_rate = 0: frozen
        elif ".shared_experts." in name or ".router." in name:
            assert m > 0.0, name  # the shared expert, its gate, the router are trained
    # big enough that a wrong gradient scale in another layout shows beyond 1e-5 (slow test)
    assert max(moved.values()) > 1e-3


@pytest.mark.parametrize("change", [dict(zero_expert_bias=True), dict(n_group=1, topk_group=1),
                                    dict(routed_scaling_factor=1.0)],
                         ids=["no_expert_bias", "no_groups", "no_scaling"])
def test_glm4_moe_routing_features_are_what_the_match_rests_on(tiny, one_process, change):
    """transformers without one of the router's features is far from megatron's answer, so the
    1e-5 match above shows megatron computes each of them."""
    assert distance_from_transformers(one_process, "glm4_moe", tiny["glm4_moe"], **change) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor=2), dict(expert=2)], ids=["tp2", "ep2"])
def test_layouts_on_two_ranks_equal_one_process(tiny, ckpts, one_process, layout):
    """TP2 (sequence parallel, shared experts split over TP) and EP2 x DP2 (experts across ranks,
    distributed optimizer) on real gloo ranks: the one-process log-probs, the sync streams every
    HF tensor bit-exactly, and a GSPO step leaves the one-process parameters."""
    cases = [(arch, str(tiny[arch]), layout, str(ckpts[arch])) for arch in ARCHS]
    ranks = run_distributed(run_cases, 2, (cases,), timeout=600)
    for arch in ARCHS:
        assert_layout_equals_one_process(ranks, arch, one_process, arch, tiny[arch])
