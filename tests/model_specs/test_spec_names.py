"""One weight naming across the local and the Transformer Engine layer spec.

The TE spec cannot be built on a CPU (megatron-core 0.16.1: NameError 'TENorm'), so its names were
recorded on an H100 (megatron-core 0.16.1 and 0.19.2, TE 2.20.2) by building the
project's Actor at TP1 with each spec: tests/data/param_names/names_{te,local}_mcore0{16,19}.json
(the GPU machine's recording), holding each tiny model's HF config, its
state_dict() names and shapes and its sharded_state_dict() keys. The local spec as built here
must write exactly the TE spec's checkpoint keys, and every live TE name must map onto the weight
map's. scripts/gpu_check.sh confirms it on a GPU, loading each spec's checkpoint into the other.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "param_names"
RECORDED = sorted(DATA.glob("names_*.json"))
MODELS = ("qwen3_moe_tiny", "qwen3_dense_tiny")


def _recorded(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _local_model(hf: dict):
    """A TP1 GPTModel of the local spec on the meta device, as the converter builds it."""
    from gspo_megatron.checkpoint.convert import meta_model_state
    from gspo_megatron.parallel.cpu_compat import apply
    apply()
    return meta_model_state(hf, torch.float32)


@pytest.fixture(scope="module")
def one_process_megatron():
    from gspo_megatron.checkpoint.convert import single_process_megatron
    with single_process_megatron():
        yield


def test_the_recorded_files_are_what_they_say():
    assert len(RECORDED) == 4
    for path in RECORDED:
        rec = json.loads(path.read_text())
        assert rec["spec"] in path.name and rec["megatron_core"].replace(".", "")[:3] in path.name
        assert set(MODELS) <= set(rec)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("version", ["016", "019"])
def test_local_spec_writes_the_te_specs_checkpoint_keys(one_process_megatron, model, version):
    te = _recorded(f"names_te_mcore{version}")[model]
    sharded, _ = _local_model(te["hf_config"])
    keys = {v.key: v for v in sharded.values()}  # the checkpoint keys (dict keys are module paths)
    want = {k: v for k, v in te["sharded_state_dict"].items() if not k.endswith("_extra_state")}
    assert set(keys) == set(want), sorted(set(keys) ^ set(want))
    for key, (kind, shape) in want.items():
        assert type(keys[key]).__name__ == kind, key
        if kind == "ShardedTensor":
            assert list(keys[key].global_shape) == shape, key


def test_before_the_fix_moe_checkpoint_keys_differed():
    """Why te_checkpoint_keys exists: the recorded local-spec MoE keys (built without it) name the
    pre-MLP norm mlp.linear_fc1.layer_norm_weight, the TE spec pre_mlp_layernorm.weight."""
    for version in ("016", "019"):
        local = set(_recorded(f"names_local_mcore{version}")["qwen3_moe_tiny"]["sharded_state_dict"])
        te = set(_recorded(f"names_te_mcore{version}")["qwen3_moe_tiny"]["sharded_state_dict"])
        diff = {k for k in local ^ te if not k.endswith("_extra_state")}
        assert diff == {f"decoder.layers.{i}.{n}" for i in range(4)
                        for n in ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("version", ["016", "019"])
def test_live_te_names_map_onto_the_weight_map(one_process_megatron, model, version):
    from model_specs.weights.maps import canonical_megatron_name, weight_map_for
    te = _recorded(f"names_te_mcore{version}")[model]
    local = _recorded(f"names_local_mcore{version}")[model]
    te_names = {k: v for k, v in te["state_dict"].items() if not k.endswith("_extra_state")}
    canonical = {canonical_megatron_name(k): v for k, v in te_names.items()}
    assert canonical == {k: v for k, v in local["state_dict"].items() if not k.endswith("_extra_state")}
    assert set(canonical) == set(weight_map_for(te["hf_config"]).by_megatron_name())
    _, params = _local_model(te["hf_config"])
    assert {k: list(p.shape) for k, p in params.items()} == canonical


def test_grouped_gemm_expert_names_map_to_sequential_ones():
    """TE's grouped-GEMM experts (moe_grouped_gemm) hold `linear_fc{1,2}.weight{e}` per expert
    (megatron extensions/transformer_engine.py, TEGroupedLinear); not in the recording (grouped
    GEMM was off), so checked against the pattern."""
    from model_specs.weights.maps import canonical_megatron_name
    assert canonical_megatron_name("decoder.layers.7.mlp.experts.linear_fc1.weight13") == \
        "decoder.layers.7.mlp.experts.local_experts.13.linear_fc1.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.experts.linear_fc2.weight0") == \
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.router.weight") == "decoder.layers.0.mlp.router.weight"


def test_mla_layers_write_the_te_specs_keys_and_te_names_map_to_the_local_ones(one_process_megatron):
    """Multi-latent attention (DeepSeek-V3) is not in the recording. Its TE layer (gpt_layer_specs.py,
    get_gpt_layer_with_transformer_engine_spec with multi_latent_attention; 0.16.1 and 0.19.2)
    fuses the latents' norms into linear_q_up_proj / linear_kv_up_proj and a dense layer's pre-MLP
    norm into linear_fc1, and keeps input_layernorm and an MoE layer's pre_mlp_layernorm apart: the
    local spec must write those keys, and the live TE names map back to the weight map's."""
    from model_specs.hf.tiny import deepseek_v3
    from model_specs.weights.maps import canonical_megatron_name
    sharded, params = _local_model(deepseek_v3(num_hidden_layers=2))
    keys = {v.key for v in sharded.values()}  # the checkpoint keys (without _extra_state)
    layer = {k.split(".", 3)[3] for k in keys if k.startswith("decoder.layers.0.")}
    assert {"input_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"} <= layer
    assert not any("layernorm" in k and "input_layernorm" not in k for k in layer)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in keys  # MoE: a norm of its own in both
    te_names = {"decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight":
                "decoder.layers.0.self_attention.q_layernorm.weight",
                "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight":
                "decoder.layers.0.self_attention.kv_layernorm.weight",
                "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": "decoder.layers.0.pre_mlp_layernorm.weight"}
    for te, local in te_names.items():
        assert canonical_megatron_name(te) == local and local in params


def test_deltanet_layers_write_the_te_specs_keys_and_te_names_map_to_the_local_ones(one_process_megatron):
    """Qwen3-Next is not in the recording. Its TE DeltaNet layer (model_specs/features/gated_delta_net/layers.py, as megatron's
    own experimental spec) fuses the input norm into in_proj (TELayerNormColumnParallelLinear):
    the local layer writes that key, megatron saves in_proj and conv1d split per block, and the
    full-attention layer keeps linear_qkv's fused norm key."""
    from model_specs.hf.tiny import qwen3_next
    from model_specs.weights.maps import canonical_megatron_name
    sharded, params = _local_model(qwen3_next())
    keys = {v.key for v in sharded.values() if hasattr(v, "key")}
    linear = {k.split(".", 3)[3] for k in keys if k.startswith("decoder.layers.0.")}
    assert "self_attention.in_proj.layer_norm_weight" in linear
    assert "input_layernorm.weight" not in linear and "self_attention.out_norm.weight" in linear
    full = {k.split(".", 3)[3] for k in keys if k.startswith("decoder.layers.3.")}
    assert "self_attention.linear_qkv.layer_norm_weight" in full
    te = "decoder.layers.0.self_attention.in_proj.layer_norm_weight"
    assert canonical_megatron_name(te) == "decoder.layers.0.input_layernorm.weight" in params
