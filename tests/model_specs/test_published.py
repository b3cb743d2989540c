"""The published config.json of real MoE models map, and their parameter counts (computed from the
mapped TransformerConfig by model_specs.param_count) are the published ones within 2%.

The configs are the fields of each model's config.json on the Hugging Face hub (model_specs/hf/published.py,
written from the published files; no hub access in tests). Published sizes: Qwen3-30B-A3B 30.5B total / 3.3B
active, Qwen3-235B-A22B 235B / 22B, Qwen2-57B-A14B 57B / 14B (Qwen count the embedding tables
as active), GLM-4.5 355B / 32B and GLM-4.5-Air 106B / 12B (Zhipu's active counts leave the
embedding tables out, and neither count includes the multi-token-prediction layer), DeepSeek-V3
671B / 37B (the model without its 14B multi-token-prediction layer, embedding tables active: 685B
on the hub with it), Kimi-K2 1.04T / 32.6B (its technical report, arXiv 2507.20534; the model
card rounds them to 1T / 32B), gpt-oss-120b 116.8B / 5.1B and gpt-oss-20b 20.9B / 3.6B (OpenAI's
model card: active counts the output layer, not the embedding table; the experts dequantized from
MXFP4, as the trainer holds them), Qwen3-Next-80B-A3B 80B total (the model card; 79.7B
counted, 81.3B with the multi-token-prediction layer, as the hub's file listing says). Its "3B
active" is not checked: no count of its config gives it within 2% (3.87B with the embedding
tables, 3.56B without: the card rounds).
"""
from __future__ import annotations

import pytest
import torch

from model_specs import load_hf_config, model_spec_for
from model_specs.param_count import param_count
from model_specs.hf.published import (DEEPSEEK_V3, GLM_45, GLM_45_AIR, GPT_OSS_20B, GPT_OSS_120B,
                                      KIMI_K2, QWEN2_57B_A14B, QWEN3_30B_A3B, QWEN3_235B_A22B,
                                      QWEN3_NEXT_80B_A3B)

# name: (config, published total, published active, the tables active counts: "both", "none" or
# "output")
PUBLISHED = {
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30.5e9, 3.3e9, "both"),
    "Qwen3-235B-A22B": (QWEN3_235B_A22B, 235e9, 22e9, "both"),
    "Qwen2-57B-A14B": (QWEN2_57B_A14B, 57e9, 14e9, "both"),
    "GLM-4.5": (GLM_45, 355e9, 32e9, "none"),
    "GLM-4.5-Air": (GLM_45_AIR, 106e9, 12e9, "none"),
    "DeepSeek-V3": (DEEPSEEK_V3, 671e9, 37e9, "both"),
    "Kimi-K2": (KIMI_K2, 1.04e12, 32.6e9, "both"),
    "gpt-oss-120b": (GPT_OSS_120B, 116.8e9, 5.1e9, "output"),
    "gpt-oss-20b": (GPT_OSS_20B, 20.9e9, 3.6e9, "output"),
    "Qwen3-Next-80B-A3B": (QWEN3_NEXT_80B_A3B, 80e9, None, "both"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name):
    config, total, active, tables = PUBLISHED[name]
    counts = param_count(model_spec_for(config))
    got_active = counts.active - (0 if tables == "both" else counts.embedding) - \
        (counts.output if tables == "none" else 0)
    print(f"{name}: {counts.total / 1e9:.2f}B total (published {total / 1e9:g}B), "
          f"{got_active / 1e9:.2f}B active (published {active / 1e9 if active else float('nan'):g}B)")
    assert counts.total == pytest.approx(total, rel=0.02)
    if active is not None:
        assert got_active == pytest.approx(active, rel=0.02)


def test_published_configs_map_as_the_models_are_described():
    glm = model_spec_for(GLM_45).config
    assert glm.moe_layer_freq == [0] * 3 + [1] * 89 and glm.num_moe_experts == 160
    assert glm.moe_router_score_function == "sigmoid" and glm.moe_router_enable_expert_bias
    assert glm.moe_router_topk_scaling_factor == 2.5 and glm.moe_router_num_groups is None
    assert glm.moe_shared_expert_intermediate_size == 1536 and glm.qk_layernorm
    assert model_spec_for(GLM_45).rotary_percent == 0.5 and glm.kv_channels == 128
    assert not model_spec_for(GLM_45_AIR).config.qk_layernorm
    qwen2 = model_spec_for(QWEN2_57B_A14B).config
    assert qwen2.moe_shared_expert_gate and qwen2.moe_shared_expert_intermediate_size == 20480
    assert qwen2.add_qkv_bias and qwen2.moe_router_pre_softmax  # norm_topk_prob false
    # Qwen3's published long-context recipe: YaRN x4 over the 32k pretraining context
    yarn = model_spec_for(dict(QWEN3_235B_A22B, max_position_embeddings=131072, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert yarn.position_embedding_type == "yarn"
    assert yarn.config.yarn_original_max_position_embeddings == 32768
    ds = model_spec_for(DEEPSEEK_V3).config
    assert ds.multi_latent_attention and (ds.q_lora_rank, ds.kv_lora_rank) == (1536, 512)
    assert ds.moe_layer_freq == [0] * 3 + [1] * 58 and ds.num_moe_experts == 256
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk, ds.moe_router_topk) == (8, 4, 8)
    assert ds.moe_router_topk_scaling_factor == 2.5 and ds.moe_shared_expert_intermediate_size == 2048
    assert (ds.rope_type, ds.rotary_scaling_factor, ds.mscale, ds.mscale_all_dim) == ("yarn", 40, 1.0, 1.0)
    oss = model_spec_for(GPT_OSS_120B).config
    assert oss.num_moe_experts == 128 and oss.moe_router_topk == 4 and oss.moe_ffn_hidden_size == 2880
    assert oss.window_size == (127, 0) and oss.window_attn_skip_freq == [1, 0] * 18
    assert oss.activation_func_clamp_value == 7.0 and oss.softmax_type == "learnable"
    assert oss.yarn_rotary_scaling_factor == 32.0 and not oss.yarn_correction_range_round_to_int
    kimi = model_spec_for(KIMI_K2)
    assert kimi.family == "deepseek_v3" and kimi.config.moe_router_num_groups is None
    assert kimi.config.num_moe_experts == 384 and kimi.config.moe_layer_freq[:2] == [0, 1]
    assert (kimi.config.beta_fast, kimi.config.rotary_base) == (1.0, 50000.0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2", "llama", "qwen2_moe", "glm4_moe",
                                  "deepseek_v3", "moonlight", "gpt_oss", "qwen3_next"])
def test_count_equals_the_built_models_parameters(arch, tmp_path):
    """param_count against a GPTModel built on the meta device from each tiny family model, and
    with tied embeddings for the dense ones (moonlight: deepseek_v3 without q's bottleneck)."""
    from gspo_megatron.checkpoint.convert import meta_model_state, single_process_megatron
    from model_specs import FAMILIES

    from model_specs.hf.tiny import MOONLIGHT
    if arch == "moonlight":
        hf = FAMILIES["deepseek_v3"].tiny_hf_config(**MOONLIGHT)
    else:
        base = FAMILIES[arch].tiny
        hf = base() if base else dict(FAMILIES["qwen3"].tiny_hf_config(), model_type=arch)
    for tie in ((False, True) if arch in ("qwen3", "llama") else (False,)):
        cfg = load_hf_config(dict(hf, tie_word_embeddings=tie))
        with single_process_megatron():
            _, params = meta_model_state(cfg, torch.float32)
        assert param_count(model_spec_for(cfg)).total == sum(p.numel() for p in params.values())


def _family_configs() -> dict[str, dict]:
    from model_specs import FAMILIES
    out = {f"published {name}": config for name, (config, *_rest) in PUBLISHED.items()}
    for arch, family in FAMILIES.items():
        base = family.tiny
        out[f"tiny {arch}"] = base() if base else dict(FAMILIES["qwen3"].tiny_hf_config(), model_type=arch)
    out["tiny qwen3 tied"] = dict(out["tiny qwen3"], tie_word_embeddings=True)
    return out


def test_the_torch_free_shape_is_the_built_configs():
    """The planner reads model_specs.shape (no torch, no megatron-core) where the actor builds a
    TransformerConfig: every shape field, the vocabulary, the tying and the counts must agree, for
    each family and published model (a field mapped in one place and not the other fails here)."""
    import dataclasses

    from model_specs.shape import SHAPE_FIELDS, ShapeConfig, model_dims_for, model_shape_for
    # the multi-latent attention fields are MLATransformerConfig's: a plain one has their defaults
    default = {f.name: f.default for f in dataclasses.fields(ShapeConfig)}
    for name, config in _family_configs().items():
        shape, spec = model_shape_for(config), model_spec_for(config)
        for field in SHAPE_FIELDS:
            built = getattr(spec.config, field, default[field])
            assert getattr(shape.config, field) == built, (name, field)
        assert (shape.family, shape.vocab_size, shape.share_embeddings_and_output_weights, shape.is_moe) == (
            spec.family, spec.vocab_size, spec.share_embeddings_and_output_weights, spec.is_moe), name
        assert param_count(shape) == param_count(spec), name
        assert model_dims_for(config)["num_layers"] == spec.config.num_layers


def test_the_planner_reads_models_without_torch():
    """`gspo-megatron plan` answers in well under 2 s because it imports neither torch nor
    megatron-core (importing them took 10 s on a busy 2-core machine)."""
    import subprocess
    import sys
    code = ("import sys; from gspo_megatron.planner import command, plan; "
            "from model_specs.shape import model_shape_for; from model_specs.param_count import param_count; "
            "[param_count(model_shape_for(plan.load_model(m))) for m in ('Qwen3-235B-A22B', 'tiny-qwen3-moe')]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')]; "
            "assert not bad, bad[:5]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("change", [
    dict(model_type="llama", mlp_bias=True), dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
    dict(partial_rotary_factor=0.5), dict(hidden_act="gelu"), dict(use_sliding_window=True)])
def test_the_shape_refuses_what_the_model_spec_refuses(change):
    """The planner must not plan a model that `train` would refuse: the same one-line error."""
    from model_specs import HFConfigError
    from model_specs.hf.tiny import qwen3 as tiny_hf_config
    from model_specs.shape import model_shape_for
    config = tiny_hf_config(**change)
    with pytest.raises(HFConfigError) as by_spec:
        model_spec_for(config)
    with pytest.raises(HFConfigError) as by_shape:
        model_shape_for(config)
    assert str(by_shape.value) == str(by_spec.value)
