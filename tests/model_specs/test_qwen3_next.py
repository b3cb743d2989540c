"""Qwen3-Next (qwen3_next): the config mapping and what it refuses, the weight map against the HF
files (the DeltaNet's in_proj_qkvz / in_proj_ba fused into one in_proj, q_proj's output gate into
linear_qkv), HF -> megatron -> HF bit-exact, megatron's log-probs against transformers' on a tiny
model, what that match rests on, and (slow) TP2, PP2 and EP2 on gloo ranks against one process.

The tiny model (tools/make_tiny_model.py, 4 layers) has three Gated DeltaNet layers (2 key heads,
4 value heads) and one gated full-attention layer with a quarter of each head rotated, a gated
shared expert and top-2 of 4 experts; its norms and dt_bias are drawn at random. On this CPU
megatron runs the DeltaNet with the torch forms of flash-linear-attention's kernels
(model_specs/features/gated_delta_net/layers.py); transformers runs its own torch forms.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from family_checks import (assert_layout_equals_one_process, assert_one_process_equals_transformers,
                           distance_from_transformers, moved_by_the_step, run_cases, zero_params)
from fixtures_models import assert_same_hf_weights
from model_specs import HFConfigError, model_spec_for
from model_specs.shape import model_shape_for
from model_specs.hf.tiny import qwen3_next
from model_specs.weights.maps import weight_map_for
from tools.make_tiny_model import make_tiny_model

NAME = "qwen3_next"
LAYOUTS = {"tp2": dict(tensor=2), "pp2": dict(pipeline=2), "ep2": dict(expert=2),
           "tp2_ep2": dict(tensor=2, expert=2, expert_tensor=1)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "hf", seed=7,
                           initializer_range=0.1)


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    return convert_hf_to_megatron(tiny, tmp_path_factory.mktemp("qwen3_next_mcore") / "m")


# ---------------------------------------------------------------- config mapping (fast)
def test_maps_the_hybrid_layers_gate_norms_and_moe():
    spec = model_spec_for(qwen3_next())
    c = spec.config
    assert c.experimental_attention_variant == "gated_delta_net"
    assert c.linear_attention_freq == [1, 1, 1, 0]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim) == (2, 4, 16, 16, 4)
    assert c.attention_output_gate and c.layernorm_zero_centered_gamma and c.qk_layernorm
    assert spec.rotary_percent == 0.25 and (c.kv_channels, c.num_query_groups) == (16, 2)
    assert c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size == 64
    assert (c.num_moe_experts, c.moe_router_topk) == (4, 2) and not c.moe_router_pre_softmax
    assert c.deterministic_mode  # the torch kernels on a machine without CUDA (model_specs/features/gated_delta_net/layers.py)
    custom = model_spec_for(qwen3_next(layer_types=["linear_attention", "full_attention"] * 2))
    assert custom.config.linear_attention_freq == [1, 0, 1, 0]


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types=.* is not supported"),
    (dict(layer_types=["full_attention"] * 3), "layer_types=.* is not supported: expected 4"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple"),
    (dict(linear_conv_kernel_dim=None), "lacks required field 'linear_conv_kernel_dim'"),
])
def test_what_megatron_would_compute_differently_is_refused_by_name(change, match):
    config = qwen3_next(**change)
    with pytest.raises(HFConfigError, match=match) as by_spec:
        model_spec_for(config)
    with pytest.raises(HFConfigError) as by_shape:
        model_shape_for(config)
    assert str(by_shape.value) == str(by_spec.value)


def test_context_parallelism_is_refused():
    with pytest.raises(HFConfigError, match="context parallelism with Gated DeltaNet"):
        model_spec_for(qwen3_next(), overrides=dict(context_parallel_size=2))


def test_layouts_must_split_the_deltanet_key_heads():
    from gspo_megatron.parallel.layout import LayoutError, ParallelLayout
    from model_specs import model_dims_for

    dims = model_dims_for(qwen3_next(linear_num_key_heads=1, linear_num_value_heads=4))
    with pytest.raises(LayoutError, match="linear_num_key_heads .* 1 is not divisible by tensor 2"):
        ParallelLayout(tensor=2).validate_model(**dims)


# ---------------------------------------------------------------- weight map and conversion
def test_weight_map_covers_every_hf_tensor_with_its_shape(tiny):
    hf = load_file(tiny / "model.safetensors")
    wmap = weight_map_for(model_spec_for(tiny).hf_config)
    assert sorted(set(wmap.hf_names())) == sorted(hf)
    by = wmap.by_megatron_name()
    in_proj = by["decoder.layers.0.self_attention.in_proj.weight"]
    assert in_proj.hf == ("model.layers.0.linear_attn.in_proj_qkvz.weight",
                          "model.layers.0.linear_attn.in_proj_ba.weight")
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in by
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in by
    # HF holds per key head 96 rows: q (16), k (16), v and z of its 2 value heads (32 each);
    # megatron q (32 rows), k (32), v (64), z (64), beta (4), alpha (4)
    fused = wmap.to_megatron(in_proj, [hf[n] for n in in_proj.hf])
    qkvz = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert torch.equal(fused[16:32], qkvz[96:112]) and torch.equal(fused[48:64], qkvz[112:128])
    assert torch.equal(fused[96:128], qkvz[128:160]) and torch.equal(fused[160:192], qkvz[160:192])
    ba = hf["model.layers.0.linear_attn.in_proj_ba.weight"]   # per key head: beta (2), alpha (2)
    assert torch.equal(fused[194:196], ba[4:6]) and torch.equal(fused[196:198], ba[2:4])
    # the full-attention layer's gate: HF q_proj holds head h's query then its gate
    qkv = wmap.to_megatron(by["decoder.layers.3.self_attention.linear_qkv.weight"],
                           [hf[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    q_proj = hf["model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(qkv[32:48], q_proj[16:32]) and torch.equal(qkv[16:32], q_proj[32:48])
    for m in wmap.mappings():
        assert [tuple(hf[n].shape) for n in m.hf] == wmap.hf_shapes(m, wmap.to_megatron(
            m, [hf[n] for n in m.hf]).shape), m.megatron
    assert wmap.ignores_hf("mtp.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_of_the_deltanet_hold_their_heads_of_every_block(tp):
    """A TP rank's in_proj shard is its key heads' [q, k, v, z, beta, alpha] (megatron's forward
    splits it so); joining the shards gives the one-process tensor back."""
    from gspo_megatron.actor.weights.full import join_tp_shards, shard_of
    from model_specs.weights.layouts import gdn_in_proj_blocks

    blocks = gdn_in_proj_blocks(4, 3, 8, 2)                  # q, k: 12 rows; v, z: 16; beta, alpha: 8
    full = torch.arange(sum(blocks), dtype=torch.float32)[:, None]
    shards = [shard_of(full, 0, 1, tp, r, blocks) for r in range(tp)]
    starts = [0, 12, 24, 40, 56, 64]
    for r, shard in enumerate(shards):
        want = torch.cat([full[s + r * b // tp:s + (r + 1) * b // tp] for s, b in zip(starts, blocks)])
        assert torch.equal(shard, want)
    assert torch.equal(join_tp_shards(shards, 0, 1, blocks), full)


def test_hf_megatron_hf_is_bit_exact(tiny, ckpt, tmp_path):
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    assert_same_hf_weights(tiny, convert_megatron_to_hf(ckpt, tmp_path / "back"))


@pytest.mark.parametrize("seed", [2, 3])
def test_round_trip_is_bit_exact_at_sizes_drawn_at_random(tmp_path, seed):
    """Head counts, head sizes, conv width, layer pattern and experts drawn from `seed`: megatron's
    checkpoint saves the DeltaNet's in_proj and conv1d split into keys of their own
    (gated_delta_net.py, _split_tensor_factory), which the converter places by row."""
    import random

    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    rng = random.Random(seed)
    nk, kv, layers = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.randint(2, 5)
    sizes = dict(linear_num_key_heads=nk, linear_num_value_heads=nk * rng.choice([1, 2, 3]),
                 linear_key_head_dim=2 * rng.randint(2, 9), linear_value_head_dim=2 * rng.randint(2, 9),
                 linear_conv_kernel_dim=rng.randint(2, 5), num_key_value_heads=kv,
                 num_attention_heads=kv * rng.choice([1, 2]), head_dim=4 * rng.randint(2, 5),
                 num_experts=rng.choice([2, 3, 5]), num_experts_per_tok=2, num_hidden_layers=layers,
                 layer_types=[rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)])
    hf_dir = make_tiny_model("qwen3_next", tmp_path / "hf", seed=seed, **sizes)
    back = convert_megatron_to_hf(convert_hf_to_megatron(hf_dir, tmp_path / "mcore"), tmp_path / "back",
                                  batch_bytes=1 << 10)
    assert_same_hf_weights(hf_dir, back, sizes)


# ---------------------------------------------------------------- log-probs
@pytest.fixture(scope="module")
def one_process(tiny, ckpt):
    return run_distributed(run_cases, 1, ([(NAME, str(tiny), {}, str(ckpt))],), timeout=600)[0]


def test_one_process_log_probs_equal_transformers(tiny, one_process):
    assert_one_process_equals_transformers(one_process, NAME, tiny)


def _no_output_gate(model):
    layer = model.model.layers[3].self_attn
    q = layer.q_proj.weight.data.view(4, 2, 16, -1)
    q[:, 1] = 0
    q[:, 1, :, 0] = 1e4  # sigmoid(gate) = 1 wherever hidden[0] > 0: a gate that lets all through


CONTROLS = {
    "no_deltanet_out_norm": dict(edit_model=lambda m: [l.linear_attn.norm.weight.data.fill_(1.0)
                                                       for l in m.model.layers[:3]]),
    "no_zero_centred_norms": dict(edit_model=zero_params(("input_layernorm.weight",
                                                           "post_attention_layernorm.weight"))),
    "no_shared_expert_gate": dict(edit_model=zero_params(("shared_expert_gate.weight",))),
    "full_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 1.0}),
    "no_conv": dict(edit_model=lambda m: [l.linear_attn.conv1d.weight.data.fill_(0.5)
                                          for l in m.model.layers[:3]]),
    "no_dt_bias": dict(edit_model=zero_params(("dt_bias",))),
    "no_output_gate": dict(edit_model=_no_output_gate),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_what_the_match_rests_on(tiny, one_process, control):
    """transformers without one of Qwen3-Next's features is far from megatron's answer, so the
    1e-5 match shows megatron computes each of them."""
    diff = distance_from_transformers(one_process, NAME, tiny, **CONTROLS[control])
    print(f"qwen3_next against transformers {control}: {diff:.3g}")
    assert diff > 1e-3


def test_a_gspo_step_trains_the_deltanet(tiny, one_process):
    moved = moved_by_the_step(tiny, one_process[f"{NAME}/after"])
    for k, m in moved.items():
        if ".self_attention." in k or "shared_experts.gate_weight" in k:
            assert m > 0.0, k
    assert max(moved.values()) > 1e-3


@pytest.mark.slow
def test_layouts_on_two_ranks_equal_one_process(tiny, ckpt, one_process):
    """TP2 (sequence parallel; the DeltaNet's heads and every block of its in_proj and conv split),
    PP2 (two DeltaNet layers, then one and the full-attention layer), EP2 and TP2 x EP2 on the same
    2 gloo ranks: the one-process log-probs, the sync streams every HF tensor bit-exactly, and a
    GSPO step leaves the one-process parameters."""
    cases = [(f"{NAME}/{lay}", str(tiny), layout, str(ckpt)) for lay, layout in LAYOUTS.items()]
    ranks = run_distributed(run_cases, 2, (cases, 1 << 12), timeout=900)
    for case, *_ in cases:
        assert_layout_equals_one_process(ranks, case, one_process, NAME, tiny)


@pytest.mark.parametrize("profile", ["cpu", "cuda", "cuda+te", "cuda+te+apex"])
def test_each_machine_profile_resolves_its_spec_and_megatrons_config_checks(profile):
    """What a run's default compute settings give Qwen3-Next on each machine (the actor's own
    spec_for_layout, megatron's TransformerConfig checks included: its gated attention refuses
    fused_single_qkv_rope, TransformerConfig.__post_init__). Without TE the local spec; with TE (a GPU
    node's default) the TE spec, which cannot be built here (TE does not import): it is asked for
    and refused by name, then the same settings are checked with the local spec. The RoPE and
    permute fusions that the TE profiles turn on import TE in TransformerConfig. The TE spec's
    DeltaNet itself is owed a GPU run (scripts/gpu_check.sh --arch qwen3_next)."""
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.actor.settings import ComputeSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from test_settings_machine_profiles import PROFILES

    available, layout = PROFILES[profile], ParallelLayout(tensor=2, expert=2)
    kwargs = {}
    if available.transformer_engine:
        with pytest.raises(HFConfigError, match="Transformer Engine does not import here"):
            spec_for_layout(qwen3_next(), layout, available=available)
        kwargs = dict(compute=ComputeSettings(transformer_engine=False),
                      overrides={"apply_rope_fusion": False, "moe_permute_fusion": False})
    spec = spec_for_layout(qwen3_next(), layout, available=available, **kwargs)
    c = spec.config
    assert not spec.transformer_engine and c.attention_output_gate and not c.fused_single_qkv_rope
    assert c.experimental_attention_variant == "gated_delta_net" and c.linear_attention_freq == [1, 1, 1, 0]
