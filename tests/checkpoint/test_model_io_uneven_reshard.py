"""Uneven pipeline stages, slow (real gloo process groups): a checkpoint saved under an uneven
layout loads bit-exactly under PP1, an even PP2, an interleaved and the other uneven split;
HF -> megatron -> uneven layout -> HF is bit-exact, and the weight stream under the uneven layout
gives the HF tensors. The split itself and the log-probs / GSPO steps: test_layout_uneven_pipeline.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.parallel.layout import ParallelLayout

# --- slow: checkpoints, resharding, HF export, weight stream -------------------------------------
# Per model: the uneven layout that loads the converted checkpoint and saves, then the layouts that
# load what it saved (the even PP2 saves again, and the uneven layout loads that back). A dense layer (mlp_only_layers=[2]) among the MoE layers: a layer in the wrong
# place has other parameters, not just other values.
RESHARD_CASES = {
    "4layers": (4, dict(pipeline=2, first_stage_layers=3), {
        "pp1": dict(), "pp2": dict(pipeline=2), "pp2_last3": dict(pipeline=2, last_stage_layers=3),
        "pp2_vpp2": dict(pipeline=2, virtual_pipeline=2)}),
    "6layers_vpp": (6, dict(pipeline=2, virtual_pipeline=2, first_stage_layers=2), {
        "pp1": dict(), "pp2": dict(pipeline=2),
        "pp2_first4": dict(pipeline=2, first_stage_layers=4),
        "pp2_vpp2_last2": dict(pipeline=2, virtual_pipeline=2, last_stage_layers=2),
        "pp2_vpp3": dict(pipeline=2, virtual_pipeline=3)}),
}


def _reshard(rank, world, ckpt, work, uneven, others):
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.build import build_model_chunks, spec_for_layout
    from gspo_megatron.actor.weights.full import full_state_dict, load_full_state_dict
    from gspo_megatron.checkpoint import checkpoint_hf_config, load_model, save_model
    from gspo_megatron.parallel.model_chunks import unwrap
    from gspo_megatron.parallel.process_groups import init_process_groups
    from gspo_megatron.sync import build_plan, stream_hf_weights
    from model_specs.weights.maps import weight_map_for

    hf = checkpoint_hf_config(ckpt)
    work = Path(work)

    def build(kwargs):
        layout = ParallelLayout(**kwargs)
        init_process_groups(layout)
        return build_model_chunks(spec_for_layout(hf, layout), layout)

    def stream(chunks):
        wmap = weight_map_for(hf)
        got = {}
        plan = build_plan(chunks, wmap)
        for bucket in stream_hf_weights(chunks, wmap, plan, bucket_bytes=40_000):
            got.update(bucket)
        return got if rank == 0 else None

    out = {}
    chunks = build(uneven)  # the converted checkpoint under the uneven layout
    load_model(chunks, ckpt)
    layers = [[layer.layer_number - 1 for layer in unwrap(c).decoder.layers] for c in chunks]
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, (ps.get_pipeline_model_parallel_rank(), layers))
    out["layers"] = dict(everyone)
    save_model(chunks, work / "resaved", hf_dir=Path(ckpt) / "hf")  # -> HF export (parent)
    out["stream"] = stream(chunks)
    # Distinct weights for the resharding: every tensor moved by seeded noise, saved uneven.
    full = full_state_dict(chunks)
    g = torch.Generator().manual_seed(5)
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in full.items()}
    load_full_state_dict(chunks, moved)
    save_model(chunks, work / "moved")
    out["moved"] = moved if rank == 0 else None
    for name, kwargs in others.items():
        chunks = build(kwargs)
        load_model(chunks, work / "moved")
        out[name] = full_state_dict(chunks, to_all_ranks=False)
        if name == "pp2":  # and back: written under the even PP2, read under the uneven layout
            save_model(chunks, work / "from_even")
    chunks = build(uneven)
    load_model(chunks, work / "from_even")
    out["back"] = full_state_dict(chunks, to_all_ranks=False)
    chunks = build({})  # one model per rank (PP1, DP2): the stream of one process
    load_model(chunks, ckpt)
    out["stream_pp1"] = stream(chunks)
    return out


@pytest.mark.slow
@pytest.mark.mcore019
@pytest.mark.parametrize("case", sorted(RESHARD_CASES))
def test_uneven_checkpoint_reshards_exports_and_streams_bit_exact(tmp_path, case):
    from safetensors.torch import load_file

    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from tools.make_tiny_model import make_tiny_model

    num_layers, uneven, others = RESHARD_CASES[case]
    hf_dir = make_tiny_model("qwen3_moe", tmp_path / "hf", seed=3, num_hidden_layers=num_layers,
                             mlp_only_layers=[2])
    ckpt = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    results = run_distributed(_reshard, 2, (str(ckpt), str(tmp_path), uneven, others), timeout=600)
    out = results[0]

    # megatron built the split the layout describes: [pp rank][virtual stage] -> global layers
    grid = ParallelLayout(**uneven).virtual_stage_layers(num_layers)
    assert out["layers"] == {r: [list(row[r]) for row in grid] for r in range(2)}

    # HF -> megatron -> uneven layout -> HF: bit-exact
    original = load_file(hf_dir / "model.safetensors")
    exported = load_file(convert_megatron_to_hf(tmp_path / "resaved", tmp_path / "export")
                         / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key

    # The weight stream under the uneven layout: the HF tensors, as one process streams them
    for streamed in (out["stream"], out["stream_pp1"]):
        assert sorted(streamed) == sorted(original)
        for key, t in original.items():
            assert torch.equal(streamed[key], t), key

    # Saved uneven, loaded under every other layout: the same full state dict, bit for bit
    moved = out["moved"]
    for name in [*others, "back"]:
        got = out[name]
        assert sorted(got) == sorted(moved), name
        for key, t in moved.items():
            assert torch.equal(got[key], t), (name, key)
