"""model_specs/weights/maps.py: fused layouts as megatron-core reads them, coverage of every family."""
from __future__ import annotations

import pytest
import torch

from model_specs.hf.config import normalize_hf_config
from model_specs.weights.layouts import fuse_qkv, split_qkv
from model_specs.weights.maps import GATE_UP, QKV, weight_map_for
from model_specs import HFConfigError as ConfigError
from model_specs.hf.tiny import qwen3, qwen3_moe


def test_fused_qkv_is_what_megatron_attention_splits():
    np_, ng, hn, h = 8, 2, 4, 3
    q = torch.arange(np_ * hn * h, dtype=torch.float32).reshape(np_ * hn, h)
    k = -torch.arange(ng * hn * h, dtype=torch.float32).reshape(ng * hn, h) - 1
    v = k - 1000
    qkv = fuse_qkv(q, k, v, np_, ng, hn)
    # megatron attention.py get_query_key_value_tensors: [.., ng, (np/ng + 2) * hn] then split.
    x = (torch.ones(1, h) @ qkv.t()).view(ng, (np_ // ng + 2) * hn)  # one token's projection
    mq, mk, mv = torch.split(x, [np_ // ng * hn, hn, hn], dim=1)
    hq, hk, hv = (torch.ones(1, h) @ t.t() for t in (q, k, v))
    # Query head j of megatron is HF query head j; group g's key is HF kv head g, which HF's
    # repeat_kv gives to query heads g*np/ng ... (g+1)*np/ng - 1 as well.
    assert torch.equal(mq.reshape(np_, hn), hq.view(np_, hn))
    assert torch.equal(mk.reshape(ng, hn), hk.view(ng, hn))
    assert torch.equal(mv.reshape(ng, hn), hv.view(ng, hn))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, np_, ng, hn), (q, k, v)))


def test_qkv_bias_round_trip():
    q, k, v = torch.randn(16), torch.randn(8), torch.randn(8)
    fused = fuse_qkv(q, k, v, 4, 2, 4)
    assert fused.shape == (32,)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 4, 2, 4), (q, k, v)))


def test_moe_map_experts_router_and_dense_layers():
    wmap = weight_map_for(qwen3_moe(mlp_only_layers=[1], tie_word_embeddings=True))
    by = wmap.by_megatron_name()
    fc1 = by["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.0.mlp.experts.3.gate_proj.weight",
                      "model.layers.0.mlp.experts.3.up_proj.weight")
    assert (fc1.kind, fc1.tp_dim, fc1.expert, fc1.layer) == (GATE_UP, 0, 3, 0)
    assert by["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
    assert by["decoder.layers.1.mlp.linear_fc1.weight"].hf[0] == "model.layers.1.mlp.gate_proj.weight"
    assert "decoder.layers.1.mlp.router.weight" not in by
    assert by["decoder.layers.2.self_attention.linear_proj.weight"].tp_dim == 1
    assert by["decoder.layers.2.self_attention.linear_qkv.weight"].kind == QKV
    assert by["decoder.layers.2.self_attention.q_layernorm.weight"].tp_dim is None
    assert "output_layer.weight" not in by  # tied
    assert by["embedding.word_embeddings.weight"].tp_dim == 0


def test_families_flags():
    untied = weight_map_for(qwen3())
    assert "output_layer.weight" in untied.by_megatron_name()
    qwen2 = weight_map_for(dict(qwen3(), model_type="qwen2"))
    names = qwen2.by_megatron_name()
    assert names["decoder.layers.0.self_attention.linear_qkv.bias"].hf[2] == \
        "model.layers.0.self_attn.v_proj.bias"
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in names
    llama = weight_map_for(dict(qwen3(), model_type="llama"))
    assert not any(n.endswith(".bias") or "q_layernorm" in n for n in llama.by_megatron_name())


def test_unknown_architecture_is_named():
    with pytest.raises(ConfigError, match="unknown architecture: model_type='gpt2'"):
        weight_map_for({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_transformers5_config_names_are_normalised():
    cfg = normalize_hf_config({"num_local_experts": 8, "rope_parameters": {"rope_theta": 1e6,
                                                                            "rope_type": "default"}})
    assert cfg["num_experts"] == 8 and cfg["rope_theta"] == 1e6 and "rope_scaling" not in cfg
    scaled = normalize_hf_config({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}})
    assert scaled["rope_scaling"]["rope_type"] == "llama3"


def test_te_spec_names_map_to_the_same_parameters():
    from model_specs.weights.maps import canonical_megatron_name

    assert canonical_megatron_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") \
        == "decoder.layers.3.input_layernorm.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") \
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert canonical_megatron_name(name) == name
