"""An impossible layout fails in the Actor's constructor, naming the numbers, before any collective
(torch.distributed is never initialised, so nothing could hang)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout
from model_specs.hf.tiny import qwen3, qwen3_moe


@pytest.mark.parametrize("hf, layout, world, message", [
    (qwen3_moe(), ParallelLayout(tensor=2), 3,
     r"world size 3 is not divisible by tensor x pipeline = 2 x 1 = 2"),
    (qwen3_moe(), ParallelLayout(expert=3), 3,
     r"num_experts 4 is not divisible by expert 3"),
    (qwen3(), ParallelLayout(tensor=8), 8,
     r"num_attention_heads 4 is not divisible by tensor 8"),
    (qwen3(num_attention_heads=6, num_key_value_heads=6), ParallelLayout(tensor=4), 4,
     r"num_attention_heads 6 is not divisible by tensor 4"),
    (qwen3_moe(), ParallelLayout(pipeline=2, virtual_pipeline=4), 2,
     r"num_layers 4 is not divisible by pipeline x virtual_pipeline = 2 x 4 = 8"),
    (qwen3(num_hidden_layers=3), ParallelLayout(pipeline=2), 2,
     r"num_layers 3 is not divisible by pipeline x virtual_pipeline = 2 x 1 = 2"),
])
def test_actor_rejects_impossible_layout_before_any_collective(monkeypatch, hf, layout, world, message):
    from gspo_megatron.actor.actor import Actor

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert not dist.is_initialized()
    with pytest.raises(LayoutError, match=message):
        Actor(hf, layout)
    assert not dist.is_initialized()


def test_actor_rejects_spec_built_for_another_layout():
    from gspo_megatron.actor.build import build_model_chunks
    from gspo_megatron.actor.build import spec_for_layout

    spec = spec_for_layout(qwen3(), ParallelLayout())
    with pytest.raises(ValueError, match="ModelSpec was built for another layout"):
        build_model_chunks(spec, ParallelLayout(tensor=2))


def test_distributed_optimizer_needs_adam():
    from gspo_megatron.actor.settings import OptimizerSettings

    with pytest.raises(ValueError, match="use_distributed_optimizer=True needs optimizer='adam', got 'sgd'"):
        OptimizerSettings(optimizer="sgd", use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd', got 'lion'"):
        OptimizerSettings(optimizer="lion")


def test_optimizer_offload_needs_the_distributed_optimizer_and_a_fraction():
    from gspo_megatron.actor.settings import OptimizerSettings

    with pytest.raises(ValueError, match="optimizer_cpu_offload=True needs use_distributed_optimizer=True"):
        OptimizerSettings(optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match=r"optimizer_offload_fraction=1.5: expected a fraction in \(0, 1\]"):
        OptimizerSettings(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                          optimizer_offload_fraction=1.5)
    OptimizerSettings(use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)

