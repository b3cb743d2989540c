"""Transformer Engine's extra state stays out of model checkpoints, for every key shape TE makes.

TE's grouped linear (grouped-GEMM experts, the default with TE) writes GEMM 0's FP8 metadata as
`{prefix}_extra_state` and GEMM i's as `{prefix}_extra_state{i}`, all shards of one ShardedObject
(megatron/core/extensions/transformer_engine.py, TEGroupedLinear._sharded_state_dict_grouped). A
filter on the `_extra_state` suffix kept GEMMs 1..n-1: on an H100 no checkpoint could
be saved or loaded with grouped GEMM ("1 ShardedObject are missing"). TE cannot be built on a CPU,
so `GroupedExtraState` below reproduces that sharded state dict with megatron's own ShardedTensor
and ShardedObject, and the real save / load / convert code runs on it.
"""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.checkpoint.model_io import is_extra_state, without_extra_state

GROUPED = [f"decoder.layers.3.mlp.experts.linear_fc1._extra_state{i or ''}" for i in range(8)]


@pytest.mark.parametrize("key", GROUPED + [
    "_extra_state", "decoder.final_layernorm._extra_state",
    "module.module.decoder.layers.0.self_attention.linear_qkv._extra_state",  # DDP / Float16Module
    "model0.decoder.layers.1.mlp.experts.linear_fc2._extra_state7",
    "decoder.layers.0.mlp.experts.experts.linear_fc1._extra_state",  # a sharded (checkpoint) key
])
def test_extra_state_keys(key):
    assert is_extra_state(key)


@pytest.mark.parametrize("key", [
    "decoder.layers.3.mlp.experts.linear_fc1.weight1", "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "output_layer.weight",
    "decoder.layers.0.extra_state_proj.weight", "decoder.layers.0.x._extra_statex",
])
def test_weights_are_not_extra_state(key):
    assert not is_extra_state(key)


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel
    return GPTModel


class GroupedExtraState(_gpt_model_class()):  # type: ignore[misc]  # megatron's GPTModel, imported late
    """The checkpoint face of TE's grouped linear with `num_gemms` experts: weight{i} parameters,
    one `_extra_state` in state_dict(), per-GEMM extra-state ShardedObjects in sharded_state_dict()
    under one sharded key with the expert axis as its shape. A GPTModel by type only (the model
    I/O takes GPTModels), with none of GPTModel's layers."""

    prefix = "decoder.layers.0.mlp.experts.linear_fc1."

    def __init__(self, num_gemms: int = 4) -> None:
        torch.nn.Module.__init__(self)
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.full((3, 2), float(i))))

    def get_extra_state(self):  # what TE's modules return when FP8 is off
        return None

    def set_extra_state(self, state) -> None:
        pass

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        out, key = {}, self.prefix.rstrip(".").replace("experts.", "experts.experts.", 1)
        for i in range(self.num_gemms):
            w = getattr(self, f"weight{i}")
            out[f"weight{i}"] = ShardedTensor.from_rank_offsets(f"{key}.weight", w, (0, i, self.num_gemms),
                                                                replica_id=0)
            out[f"_extra_state{i or ''}"] = ShardedObject(f"{key}._extra_state", None,
                                                          (self.num_gemms,), (i,), replica_id=0)
        return out


@pytest.fixture()
def one_process():
    from gspo_megatron.checkpoint.convert import single_process_megatron
    with single_process_megatron():
        yield


def test_save_and_load_drop_every_gemms_extra_state(one_process, tmp_path):
    from gspo_megatron.checkpoint.model_io import load_model, model_sharded_state_dict, save_model
    src, dst = GroupedExtraState(), GroupedExtraState()
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    sd = model_sharded_state_dict([src])["model0"]
    assert sorted(sd) == [f"weight{i}" for i in range(4)]
    save_model([src], tmp_path / "ckpt")      # with GEMM 0's shard dropped alone, this raised
    load_model([dst], tmp_path / "ckpt")      # (load_state_dict's missing `_extra_state` ignored)
    for i in range(4):
        assert torch.equal(getattr(dst, f"weight{i}"), torch.full((3, 2), float(i)))


def test_the_old_suffix_filter_fails_as_on_the_gpu(one_process, tmp_path):
    """What the H100 showed, reproduced: GEMMs 1..3's extra state without GEMM 0's."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from gspo_megatron.checkpoint.model_io import TorchDcpSaveStrategy
    sd = {k: v for k, v in GroupedExtraState().sharded_state_dict().items() if not k.endswith("_extra_state")}
    (tmp_path / "old").mkdir()
    with pytest.raises(CheckpointingException, match="ShardedObject are missing"):
        dist_checkpointing.save({"model0": sd}, str(tmp_path / "old"), sharded_strategy=TorchDcpSaveStrategy())


def test_converter_drops_grouped_extra_state(one_process, monkeypatch):
    """The HF -> megatron converter describes the model by a meta GPTModel's sharded state dict:
    grouped-GEMM extra state in it (as a TE spec would add) must not reach the checkpoint."""
    from megatron.core.models.gpt import GPTModel

    from gspo_megatron.checkpoint.convert import meta_model_state
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    real = GPTModel.sharded_state_dict

    def with_grouped_extra_state(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.update({f"decoder.layers.0.mlp.experts.linear_fc1.{k}": v
                    for k, v in GroupedExtraState().sharded_state_dict().items() if "_extra_state" in k})
        return out

    monkeypatch.setattr(GPTModel, "sharded_state_dict", with_grouped_extra_state)
    sd, _ = meta_model_state(tiny_hf_config(), torch.float32)
    assert not [k for k in sd if "_extra_state" in k or "_extra_state" in getattr(sd[k], "key", "")]
    assert any(k.endswith("linear_fc1.weight") for k in sd)


def test_without_extra_state_checks_the_sharded_key_too():
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    obj = ShardedObject("decoder.layers.0.mlp.experts.experts.linear_fc1._extra_state", None, (2,), (1,))
    assert without_extra_state({"renamed": obj, "w": 1}) == {"w": 1}
