import json

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout
from gspo_megatron.actor.build import spec_for_layout
from model_specs import HFConfigError as ConfigError
from model_specs.hf.tiny import qwen3, qwen3_moe
from model_specs.norms import HAVE_TE, SequenceParallelTorchNorm


def test_qwen3_moe_maps_every_field():
    hf = qwen3_moe(mlp_only_layers=[1], rope_theta=12345.0, tie_word_embeddings=True)
    spec = spec_for_layout(hf, ParallelLayout(tensor=2, expert=2))
    c = spec.config
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (4, 64, 4, 2, 16)
    assert c.qk_layernorm and c.normalization == "RMSNorm" and c.gated_linear_unit
    assert c.activation_func is F.silu and not c.add_bias_linear and not c.add_qkv_bias
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 32)
    assert c.moe_layer_freq == [1, 0, 1, 1]
    assert c.moe_router_pre_softmax is False  # norm_topk_prob=True: top-k then softmax
    assert c.moe_aux_loss_coeff == 0.0 and c.moe_router_load_balancing_type == "none"
    assert c.sequence_parallel and c.tensor_model_parallel_size == 2 and c.expert_model_parallel_size == 2
    assert spec.rotary_base == 12345.0 and spec.share_embeddings_and_output_weights
    assert spec.vocab_size == 512 and spec.is_moe
    if not torch.cuda.is_available():
        assert c.use_cpu_initialization and not c.gradient_accumulation_fusion


def test_norm_topk_prob_false_keeps_full_softmax_probabilities():
    spec = spec_for_layout(qwen3_moe(norm_topk_prob=False), ParallelLayout())
    assert spec.config.moe_router_pre_softmax is True


def test_qwen3_dense_and_untied():
    spec = spec_for_layout(qwen3(), ParallelLayout(tensor=2))
    assert spec.config.num_moe_experts is None and not spec.is_moe
    assert not spec.config.sequence_parallel and not spec.share_embeddings_and_output_weights


def test_vpp_on_cpu_turns_batch_p2p_comm_off():
    spec = spec_for_layout(qwen3(), ParallelLayout(pipeline=2, virtual_pipeline=2))
    if not torch.cuda.is_available():
        assert spec.config.batch_p2p_comm is False


def test_config_from_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen3()))
    assert spec_for_layout(tmp_path, ParallelLayout()).family == "qwen3"


def test_bad_configs_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="unknown architecture: model_type='mamba'"):
        spec_for_layout({"model_type": "mamba"}, ParallelLayout())
    bad = qwen3()
    del bad["num_attention_heads"]
    with pytest.raises(ConfigError, match="lacks required field 'num_attention_heads'"):
        spec_for_layout(bad, ParallelLayout())
    with pytest.raises(ConfigError, match="rope_scaling"):
        spec_for_layout(qwen3(rope_scaling={"type": "yarn"}), ParallelLayout())
    with pytest.raises(FileNotFoundError, match="no HF config.json"):
        spec_for_layout(tmp_path, ParallelLayout())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        spec_for_layout(tmp_path, ParallelLayout())
    with pytest.raises(ConfigError, match="unknown TransformerConfig fields"):
        spec_for_layout(qwen3(), ParallelLayout(), overrides={"no_such_knob": 1})


def test_layout_checked_against_the_model():
    with pytest.raises(LayoutError, match="num_experts 4 is not divisible by expert 3"):
        spec_for_layout(qwen3_moe(), ParallelLayout(expert=3))


@pytest.mark.skipif(HAVE_TE, reason="local spec only without Transformer Engine")
def test_local_spec_uses_sequence_parallel_capable_norms():
    spec = spec_for_layout(qwen3_moe(), ParallelLayout(tensor=2))
    block = spec.block_spec(pp_rank=0)
    assert block.layer_norm is SequenceParallelTorchNorm
    layer = block.layer_specs[0].submodules
    assert layer.input_layernorm is SequenceParallelTorchNorm
    assert layer.self_attention.submodules.q_layernorm is SequenceParallelTorchNorm
    norm = SequenceParallelTorchNorm(spec.config, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel


def test_megatron_torch_norm_still_refuses_sequence_parallel():
    """Why SequenceParallelTorchNorm exists; if this starts passing, megatron's norm may do."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = spec_for_layout(qwen3_moe(), ParallelLayout(tensor=2))
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(spec.config, 64)
