"""DeepSeek-V3 (deepseek_v3; Kimi-K2 and Moonlight are the same architecture): the config mapping
and what it refuses, YaRN's two factors against transformers, the weight map against the HF files,
HF -> megatron -> HF bit-exact (at sizes drawn at random: tests/checkpoint/test_convert_mla.py),
megatron's log-probs against transformers' on tiny models, and (slow) TP2, PP2 and EP2 on gloo
ranks against one process.

Two tiny models (tools/make_tiny_model.py, 4 layers): "v3" is DeepSeek-V3's shape (q through a
low-rank bottleneck, YaRN x4 with mscale != mscale_all_dim, evaluated up to 2.5x its original
context, 2 expert groups of which 1 is chosen, a random expert bias, one shared expert, a dense
first layer); "moonlight" is Moonlight's (q_lora_rank null, plain RoPE, no groups, two shared
experts). One process computes log-probs with the Actor (fp32), compares them with transformers,
streams the weights as the SGLang sync does and takes one GSPO step; the slow test does the same
under each layout on 2 gloo ranks and compares with the one process.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from family_checks import (SEQ, assert_layout_equals_one_process,
                           assert_one_process_equals_transformers, distance_from_transformers,
                           moved_by_the_step, run_cases)
from fixtures_models import assert_same_hf_weights
from model_specs import HFConfigError, model_spec_for
from model_specs.shape import model_shape_for
from model_specs.hf.tiny import MOONLIGHT, deepseek_v3
from model_specs.weights.maps import weight_map_for
from tools.make_tiny_model import make_tiny_model

# initializer_range 0.1 (transformers' default 0.02 leaves attention almost uniform in a model this
# small, and YaRN's effect on the log-probs under 1e-3)
MODELS: dict[str, dict[str, Any]] = {"v3": dict(initializer_range=0.1),
          "moonlight": dict(initializer_range=0.1, q_lora_rank=None, rope_parameters=None, n_group=1,
                            topk_group=1, n_shared_experts=2)}
LAYOUTS = {"tp2": dict(tensor=2), "pp2": dict(pipeline=2), "ep2": dict(expert=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {name: make_tiny_model("deepseek_v3", root / name, seed=5, num_hidden_layers=4, **changes)
            for name, changes in MODELS.items()}


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny models converted to megatron checkpoints (tools/convert_hf_to_megatron.py)."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("deepseek_v3_mcore")
    return {name: convert_hf_to_megatron(tiny[name], root / name) for name in MODELS}


# ---------------------------------------------------------------- config mapping (fast)
def test_maps_mla_yarn_router_and_dense_layers():
    spec = model_spec_for(deepseek_v3())
    c = spec.config
    assert type(c).__name__ == "MLATransformerConfig" and c.multi_latent_attention
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == \
        (24, 32, 12, 8, 16)
    assert c.qk_layernorm and c.kv_channels == 16 and not c.apply_rope_fusion
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings) == ("yarn", 4.0, 8)
    assert (c.mscale, c.mscale_all_dim, c.beta_fast, c.beta_slow) == (1.0, 0.8, 32.0, 1.0)
    assert spec.position_embedding_type == "rope"  # GPTModel builds no RoPE for MLA: MLA's own
    assert c.moe_layer_freq == [0, 1, 1, 1] and c.num_moe_experts == 8
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (2, 1)
    assert c.moe_router_topk_scaling_factor == 2.5 and c.moe_shared_expert_intermediate_size == 32
    moon = model_spec_for(deepseek_v3(**MOONLIGHT)).config
    assert moon.q_lora_rank is None and moon.rope_type == "rope" and moon.moe_router_num_groups is None
    assert moon.moe_shared_expert_intermediate_size == 64 and moon.rotary_base == 10000.0
    assert model_spec_for(deepseek_v3(model_type="kimi_k2")).family == "deepseek_v3"


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
YARN_VARIANTS = {
    "published": dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=1.0),
    "ratio": dict(YARN, mscale=1.0, mscale_all_dim=0.8),
    "mscale_without_all_dim": dict(YARN, mscale=0.707),  # HF: the ratio only when both are set
    "all_dim_without_mscale": dict(YARN, mscale_all_dim=0.8),
    "attention_factor": dict(YARN, attention_factor=1.3, mscale=1.0, mscale_all_dim=0.8),
    "no_mscale": dict(YARN, beta_fast=8, beta_slow=0.5),
}


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_scale_factor_and_frequencies_are_transformers(variant):
    """transformers' DeepseekV3Attention.scaling and its rotary embedding's cos / sin factor and
    frequencies, against what megatron's MLA computes from the mapped config
    (MultiLatentAttention.__init__'s softmax_scale, YarnRotaryEmbedding.get_emb)."""
    import transformers
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding, _yarn_get_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                     DeepseekV3RotaryEmbedding)

    from gspo_megatron.parallel.cpu_compat import current_device_is_cpu
    scaling = YARN_VARIANTS[variant]
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in deepseek_v3().items() if k not in (
        "architectures", "model_type", "rope_scaling", "torch_dtype", "rope_theta")},
        rope_parameters={**{k: v for k, v in scaling.items() if k != "type"},
                         "rope_type": "yarn", "rope_theta": 10000.0})
    hf_rope = DeepseekV3RotaryEmbedding(hf_config)
    hf_scale = DeepseekV3Attention(hf_config, 0).scaling
    c = model_spec_for(deepseek_v3(rope_scaling=scaling)).config
    assert _yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(20) == \
        pytest.approx(hf_scale, rel=1e-12)
    with current_device_is_cpu():
        rope = YarnRotaryEmbedding(c.qk_pos_emb_head_dim, rotary_base=c.rotary_base,
                                   scaling_factor=c.rotary_scaling_factor,
                                   original_max_position_embeddings=c.original_max_position_embeddings,
                                   beta_fast=c.beta_fast, beta_slow=c.beta_slow, mscale=c.mscale,
                                   mscale_all_dim=c.mscale_all_dim)
        emb, factor = rope.get_emb(SEQ)                                        # [s, 1, 1, rope]
    assert factor == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    positions = torch.arange(SEQ, dtype=torch.float32)[:, None]
    want = torch.cat([positions * hf_rope.inv_freq] * 2, dim=-1)
    torch.testing.assert_close(emb[:, 0, 0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, match", [
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 with num_attention_heads=4"),
    (dict(rope_interleave=False), "rope_interleave=false is not supported"),
    (dict(rope_scaling=dict(YARN, truncate=False)), "YaRN with truncate=false is not supported"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type='linear' is not supported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5, but multi-latent attention"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7, expected an even number"),
    (dict(kv_lora_rank=0), "kv_lora_rank=0, expected > 0"),
    (dict(v_head_dim=None), "lacks required field 'v_head_dim'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}),
     "quantization_config (quant_method='fp8') is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=false is not supported"),
])
def test_what_megatron_would_compute_differently_is_refused_by_name(change, match):
    """The trainer (model spec) and the planner (torch-free shape) refuse with the same line."""
    config = deepseek_v3(**change)
    with pytest.raises(HFConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as by_spec:
        model_spec_for(config)
    with pytest.raises(HFConfigError) as by_shape:
        model_shape_for(config)
    assert str(by_shape.value) == str(by_spec.value)
    assert "\n" not in str(by_spec.value)


def test_tensor_parallel_without_sequence_parallel_is_refused():
    """Each rank would keep only its heads' share of the shared rope key's gradient (mla.py)."""
    with pytest.raises(HFConfigError, match="needs sequence parallelism"):
        model_spec_for(deepseek_v3(), overrides=dict(tensor_model_parallel_size=2,
                                                     sequence_parallel=False))


def test_the_mtp_layers_are_left_out_and_said_so():
    from model_specs.hf.config import left_out_layers_note
    from model_specs.hf.published import DEEPSEEK_V3
    wmap = weight_map_for(deepseek_v3(num_nextn_predict_layers=1))
    assert wmap.ignores_hf("model.layers.4.eh_proj.weight")
    assert wmap.ignores_hf("model.layers.4.self_attn.kv_b_proj.weight")
    assert not wmap.ignores_hf("model.layers.3.self_attn.kv_b_proj.weight")
    note = left_out_layers_note(DEEPSEEK_V3)
    assert "1 multi-token-prediction layer(s)" in note and "model.layers.61.*" in note
    assert "speculative decoding" in note and left_out_layers_note(deepseek_v3()) is None


def test_the_local_spec_adaptations_are_still_needed():
    """megatron-core's local DotProductAttention still takes no k_channels / v_channels (what
    model_specs.features.mla.layers.LocalMLACoreAttention adds), and 0.16.1's MLA module still believed TE
    present without it (what fix_have_te corrects; 0.19 reads the real flag). When an upgrade
    fixes them, this fails and the adaptations can go."""
    import inspect

    import megatron.core
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from model_specs.features.mla import layers as mla
    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    assert multi_latent_attention.HAVE_TE is False  # no TE on this machine
    assert mla.FIXED_HAVE_TE == megatron.core.__version__.startswith("0.16")


# ---------------------------------------------------------------- weight map and conversion
@pytest.mark.parametrize("name", sorted(MODELS))
def test_weight_map_covers_every_hf_tensor_with_its_shape(tiny, name):
    hf = load_file(tiny[name] / "model.safetensors")
    wmap = weight_map_for(model_spec_for(tiny[name]).hf_config)
    assert sorted(wmap.hf_names()) == sorted(hf)
    by = wmap.by_megatron_name()
    assert by["decoder.layers.2.self_attention.linear_kv_up_proj.weight"].hf == \
        ("model.layers.2.self_attn.kv_b_proj.weight",)
    q = "linear_q_proj" if name == "moonlight" else "linear_q_up_proj"
    assert f"decoder.layers.0.self_attention.{q}.weight" in by
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in by
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0


def test_hf_megatron_hf_is_bit_exact(tiny, ckpts, tmp_path):
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    for name in MODELS:
        assert_same_hf_weights(tiny[name], convert_megatron_to_hf(ckpts[name], tmp_path / name), name)


# ---------------------------------------------------------------- log-probs


@pytest.fixture(scope="module")
def one_process(tiny, ckpts):
    cases = [(name, str(tiny[name]), {}, str(ckpts[name])) for name in MODELS]
    return run_distributed(run_cases, 1, (cases,), timeout=600)[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_process_log_probs_equal_transformers(tiny, one_process, name):
    assert_one_process_equals_transformers(one_process, name, tiny[name])


@pytest.mark.parametrize("change", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 8}),
    dict(zero_expert_bias=True), dict(n_group=1, topk_group=1), dict(routed_scaling_factor=1.0)],
    ids=["no_yarn", "yarn_without_mscales", "no_expert_bias", "no_groups", "no_scaling"])
def test_what_the_v3_match_rests_on(tiny, one_process, change):
    """transformers without YaRN, without its mscales (beyond the original 8 positions), or
    without one of the router's features is far from megatron's answer, so the 1e-5 match shows
    megatron computes each of them."""
    diff = distance_from_transformers(one_process, "v3", tiny["v3"], **change)
    print(f"v3 against transformers with {change}: {diff:.3g}")
    assert diff > 1e-3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_gspo_step_trains_everything_but_the_expert_bias(tiny, one_process, name):
    moved = moved_by_the_step(tiny[name], one_process[f"{name}/after"])
    for k, m in moved.items():
        if k.endswith("expert_bias"):
            assert m == 0.0, k  # moe_router_bias_update_rate = 0: frozen
        elif ".self_attention." in k or ".shared_experts." in k or ".router." in k:
            assert m > 0.0, k  # every projection and norm of MLA, the shared experts, the router
    assert max(moved.values()) > 1e-3  # a wrong gradient scale in a layout shows beyond 1e-5


@pytest.mark.slow
def test_layouts_on_two_ranks_equal_one_process(tiny, ckpts, one_process):
    """TP2 (sequence parallel; MLA's heads, up-projections and column-parallel down-projections
    split), PP2 (2 + 2 layers) and EP2 x DP2 (experts across ranks, distributed optimizer), one
    after another on the same 2 gloo ranks: the one-process log-probs, the sync streams every HF
    tensor bit-exactly, and a GSPO step leaves the one-process parameters."""
    cases = [(f"{name}/{lay}", str(tiny[name]), layout, str(ckpts[name]))
             for lay, layout in LAYOUTS.items() for name in MODELS]
    ranks = run_distributed(run_cases, 2, (cases,), timeout=600)
    for case, hf_dir, *_ in cases:
        assert_layout_equals_one_process(ranks, case, one_process, case.split("/")[0], Path(hf_dir))
