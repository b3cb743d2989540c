"""The tensor shapes an HF config implies (model_specs/hf/tensors.py), which the start-up checks hold
a distillation teacher's weights to: every family's tiny model agrees with its own config (no
false refusal), and a config that says other sizes than its weights is named by the tensor."""
from __future__ import annotations

import json

import pytest

from fixtures_models import tiny_model_dir
from model_specs.hf.config import load_hf_config
from model_specs.hf.tensors import shape_mismatch
from tools.make_tiny_model import ARCHS


def _shapes(model) -> dict[str, list[int]]:
    from gspo_megatron.checkpoint.hf_files import read_safetensors_header, weight_files
    return {n: t["shape"] for p in weight_files(model) for n, t in read_safetensors_header(p).tensors.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_familys_weights_agree_with_its_config(arch):
    model = tiny_model_dir(arch, 0)
    assert shape_mismatch(load_hf_config(model), _shapes(model)) is None


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 640}, "config.json implies (640, 64) (vocab_size, hidden_size)"),
    ({"num_key_value_heads": 4}, "self_attn.k_proj.weight has shape"),
    ({"num_hidden_layers": 3}, "config.json has num_hidden_layers=3, the weights have no layer 2"),
    ({"num_hidden_layers": 1}, "config.json has num_hidden_layers=1, the weights have a layer 1"),
    ({"moe_intermediate_size": 48}, "mlp.experts.0.down_proj.weight has shape (64, 32), config.json implies (64, 48)"),
])
def test_a_config_that_its_weights_do_not_fit_is_named_by_the_tensor(change, message):
    model = tiny_model_dir("qwen3_moe", 0)
    config = {**json.loads((model / "config.json").read_text()), **change}
    assert message in (shape_mismatch(load_hf_config(config), _shapes(model)) or ""), change
