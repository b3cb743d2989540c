"""HF -> megatron -> HF is bit-exact for multi-latent attention models (DeepSeek-V3, Kimi-K2,
Moonlight) at sizes drawn at random: head counts, ranks and widths nobody picked, q with and
without its bottleneck, 0-2 dense layers; once (slow) through the two command lines,
tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py. The tiny models' round trip
and their log-probs: tests/model_specs/test_deepseek_v3.py."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_models import assert_same_hf_weights
from tools.make_tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def random_sizes(seed: int) -> dict:
    """A tiny DeepSeek-V3 of sizes drawn from `seed`."""
    rng = random.Random(seed)
    heads, experts = rng.choice([1, 2, 3, 5]), rng.choice([2, 3, 6])
    return dict(num_attention_heads=heads, num_key_value_heads=heads,
                hidden_size=8 * rng.randint(3, 10), intermediate_size=rng.randint(10, 70),
                q_lora_rank=rng.choice([None, rng.randint(3, 40)]), kv_lora_rank=rng.randint(3, 40),
                qk_nope_head_dim=rng.randint(1, 20), qk_rope_head_dim=2 * rng.randint(1, 6),
                v_head_dim=rng.randint(1, 20), n_routed_experts=experts,
                num_experts_per_tok=rng.randint(2, experts), moe_intermediate_size=rng.randint(4, 40),
                n_shared_experts=rng.randint(1, 2), first_k_dense_replace=rng.randint(0, 2),
                n_group=1, topk_group=1, num_hidden_layers=3, rope_parameters=None)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_round_trip_is_bit_exact_at_sizes_drawn_at_random(tmp_path, seed):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    sizes = random_sizes(seed)
    hf_dir = make_tiny_model("deepseek_v3", tmp_path / "hf", seed=seed, **sizes)
    back = convert_megatron_to_hf(convert_hf_to_megatron(hf_dir, tmp_path / "mcore"), tmp_path / "back")
    assert_same_hf_weights(hf_dir, back, sizes)


@pytest.mark.slow  # two converter processes
def test_the_command_lines_round_trip_a_drawn_model(tmp_path):
    sizes = random_sizes(1)
    hf_dir = make_tiny_model("deepseek_v3", tmp_path / "hf", seed=1, **sizes)
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, capture_output=True, text=True,
                                    check=True, timeout=300)
    run("tools/convert_hf_to_megatron.py", "--hf", str(hf_dir), "--out", str(tmp_path / "m"))
    run("tools/convert_megatron_to_hf.py", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "back"))
    assert_same_hf_weights(hf_dir, tmp_path / "back", sizes)
