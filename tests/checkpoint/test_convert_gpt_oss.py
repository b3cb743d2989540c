"""gpt-oss's checkpoints: HF -> megatron -> HF bit-exact at sizes drawn at random (experts stacked
per layer, gate and up interleaved), and the MXFP4 experts of the published checkpoints
dequantized on import exactly as transformers dequantizes them (its own function is the
reference), then exported unquantized. The tiny model's log-probs: tests/model_specs/test_gpt_oss.py."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures_models import assert_same_hf_weights
from tools.make_tiny_model import make_tiny_model


def random_sizes(seed: int) -> dict:
    """A tiny gpt-oss of sizes drawn from `seed`."""
    rng = random.Random(seed)
    kv = rng.choice([1, 2])
    experts = rng.choice([2, 3, 5])
    return dict(num_attention_heads=kv * rng.choice([1, 2, 3]), num_key_value_heads=kv,
                head_dim=2 * rng.randint(2, 10), hidden_size=8 * rng.randint(2, 8),
                intermediate_size=rng.randint(3, 40), num_local_experts=experts,
                num_experts_per_tok=rng.randint(2, experts), num_hidden_layers=rng.randint(1, 3),
                sliding_window=rng.randint(2, 16))


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_round_trip_is_bit_exact_at_sizes_drawn_at_random(tmp_path, seed):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    sizes = random_sizes(seed)
    hf_dir = make_tiny_model("gpt_oss", tmp_path / "hf", seed=seed, **sizes)
    back = convert_megatron_to_hf(convert_hf_to_megatron(hf_dir, tmp_path / "mcore"), tmp_path / "back",
                                  batch_bytes=1 << 10)
    assert_same_hf_weights(hf_dir, back, sizes)


def _random_mxfp4(g: torch.Generator, experts: int, rows: int, cols: int):
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    # exponents around 2^0 (published scales are near 2^-8 .. 2^2), and a few extreme ones
    scales = torch.randint(118, 131, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    scales.view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    return blocks, scales


def test_dequantization_is_transformers_own():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gspo_megatron.checkpoint.mxfp4 import dequantize_mxfp4
    g = torch.Generator().manual_seed(0)
    for experts, rows, cols in ((3, 10, 64), (1, 6, 32), (4, 2, 96)):
        blocks, scales = _random_mxfp4(g, experts, rows, cols)
        for dtype in (torch.bfloat16, torch.float32):
            want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)           # [E, cols, rows]
            got = dequantize_mxfp4(blocks, scales, dtype)
            assert got.shape == (experts, cols, rows) and got.dtype == dtype
            assert torch.equal(got, want), (experts, rows, cols, dtype)


def test_an_mxfp4_checkpoint_imports_dequantized_and_exports_unquantized(tmp_path):
    """A tiny gpt-oss stored as the published ones are (experts as X_blocks / X_scales, the rest
    bf16, quantization_config mxfp4): the converter's checkpoint holds transformers' dequantized
    experts, and the export writes them in bf16 under their plain names without
    quantization_config."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from model_specs import model_spec_for
    hf_dir = make_tiny_model("gpt_oss", tmp_path / "hf", seed=1, hidden_size=64, intermediate_size=32,
                             num_hidden_layers=2)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(hf_dir / "model.safetensors").items()}
    g = torch.Generator().manual_seed(1)
    want = {}
    for layer in range(2):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = _random_mxfp4(g, 8, rows, cols)
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            want[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
            assert want[name].shape == (8, cols, rows)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert model_spec_for(hf_dir).family == "gpt_oss"

    mcore = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    assert "quantization_config" not in json.loads((mcore / "hf" / "config.json").read_text())
    back = convert_megatron_to_hf(mcore, tmp_path / "back")
    out = load_file(back / "model.safetensors")
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    assert not any(k.endswith(("_blocks", "_scales")) for k in out)
    for name, t in want.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], t), name
    for name, t in tensors.items():
        if not name.endswith(("_blocks", "_scales")):
            assert torch.equal(out[name], t), name
