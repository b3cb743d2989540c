"""tools/convert_*: one-process round trips for every family, and clear errors on bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures_models import assert_same_hf_weights, tiny_model_dir
from gspo_megatron.checkpoint import CheckpointMismatchError, check_layout_fits
from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
from gspo_megatron.checkpoint.export import convert_megatron_to_hf
from gspo_megatron.parallel.layout import ParallelLayout
from model_specs import HFConfigError as ConfigError
from model_specs.weights.maps import WeightMapError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_one_process_round_trip_is_bit_exact(tmp_path, arch, tie):
    src = tiny_model_dir(arch, seed=5, tie=tie)
    ckpt = convert_hf_to_megatron(src, tmp_path / "mcore")
    assert (ckpt / "metadata.json").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()
    out = convert_megatron_to_hf(ckpt, tmp_path / "hf")
    assert_same_hf_weights(src, out)
    assert (out / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()


@pytest.mark.slow  # three converter processes (20 s)
def test_command_lines_with_dtype_and_shards(tmp_path):
    src = tiny_model_dir("qwen3_moe", seed=0)
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, capture_output=True, text=True,
                                    check=True)
    run("tools/convert_hf_to_megatron.py", "--hf", str(src), "--out", str(tmp_path / "m"),
        "--dtype", "bfloat16")
    run("tools/convert_megatron_to_hf.py", "--megatron", str(tmp_path / "m"), "--out",
        str(tmp_path / "hf"), "--max-shard-gb", "0.0001")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    original = load_file(src / "model.safetensors")
    got = {}
    for shard in shards:
        got.update(load_file(tmp_path / "hf" / shard))
    assert sorted(got) == sorted(original)
    assert all(torch.equal(got[k], original[k].to(torch.bfloat16)) for k in got)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tmp_path):
    src = _edited_copy(tiny_model_dir("qwen3"), tmp_path / "hf",
                       lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(WeightMapError, match="missing tensor model.layers.1.self_attn.k_norm.weight"):
        convert_hf_to_megatron(src, tmp_path / "out")
    assert not (tmp_path / "out" / "metadata.json").exists()  # nothing that looks complete


def test_wrong_shape_is_named(tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100]
    src = _edited_copy(tiny_model_dir("qwen3"), tmp_path / "hf", edit)
    with pytest.raises(WeightMapError, match=r"model.layers.0.mlp.up_proj.weight .* has shape "
                                             r"\(100, 64\), the config implies \(128, 64\)"):
        convert_hf_to_megatron(src, tmp_path / "out")


def test_an_integer_tensor_is_refused_never_cast(tmp_path):
    """megatron's parameters are floating point: an int32 tensor in model.safetensors was cast to
    float32 without a word (exact only below 2^24). It is refused, naming it, before anything is
    written; the tool says so in one line, exit 2."""
    name = "model.layers.0.self_attn.q_proj.weight"
    src = _edited_copy(tiny_model_dir("qwen3"), tmp_path / "hf",
                       lambda t: t.update({name: (t[name] * 1000).to(torch.int32)}))
    with pytest.raises(WeightMapError, match=rf"HF tensor {name} in {src / 'model.safetensors'} is int32: the "
                                             "megatron checkpoint holds floating-point parameters"):
        convert_hf_to_megatron(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from tools.convert_hf_to_megatron import main
    assert main(["--hf", str(src), "--out", str(tmp_path / "out")]) == 2


def test_tensors_the_map_does_not_use_are_named(tmp_path):
    src = _edited_copy(tiny_model_dir("qwen3"), tmp_path / "hf",
                       lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.ones(2)}))
    with pytest.raises(WeightMapError, match="does not use.*shared_expert"):
        convert_hf_to_megatron(src, tmp_path / "out")


def test_unknown_architecture_is_named(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_model_dir("qwen3"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(ConfigError, match="unknown architecture: model_type='mamba'"):
        convert_hf_to_megatron(src, tmp_path / "out")


def test_config_checkpoint_mismatch_and_unfit_layout(tmp_path):
    ckpt = convert_hf_to_megatron(tiny_model_dir("qwen3_moe"), tmp_path / "mcore")
    check_layout_fits(ckpt, ParallelLayout(tensor=2, pipeline=2, expert=2), world_size=8)
    with pytest.raises(CheckpointMismatchError, match="cannot be resharded to TP3.*num_attention_heads 4"):
        check_layout_fits(ckpt, ParallelLayout(tensor=3), world_size=3)
    with pytest.raises(CheckpointMismatchError, match="cannot be resharded.*num_experts 4 is not "
                                                      "divisible by expert 8"):
        check_layout_fits(ckpt, ParallelLayout(expert=8), world_size=8)
    cfg_path = ckpt / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "moe_intermediate_size": 48, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointMismatchError,
                       match=r"(?s)decoder.layers.0.mlp.experts.experts.linear_fc2.weight: global "
                             r"shape \(4, 64, 32\) in the checkpoint, the model expects \(4, 64, 48\)"
                             r".*decoder.layers.2.mlp.router.weight: missing from the checkpoint"):
        convert_megatron_to_hf(ckpt, tmp_path / "hf")


def test_not_a_checkpoint_and_non_empty_output(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a megatron dist_checkpointing checkpoint"):
        convert_megatron_to_hf(tmp_path, tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    from gspo_megatron.checkpoint.output_dirs import OutputDirError
    with pytest.raises(OutputDirError, match="is a non-empty folder that gspo-megatron did not write"):
        convert_hf_to_megatron(tiny_model_dir("qwen3"), tmp_path / "busy")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["x"]
