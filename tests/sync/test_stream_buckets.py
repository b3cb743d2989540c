"""The sync's buckets (gspo_megatron/sync/stream.py): bounded in bytes, and never cut between the
HF tensors that SGLang must load in one call (DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa,
which its loader fuses: a cut between them left a layer's old weights on the server, 8e-3 off
after one GSPO step, tests/sync/test_weight_sync_families.py)."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.sync.stream import PlanEntry, buckets
from model_specs.hf.tiny import deepseek_v3, qwen3_moe
from model_specs.weights.maps import weight_map_for


def _plan(hf: dict) -> list[PlanEntry]:
    return [PlanEntry(m, 0, (100 * (1 + i % 7),), torch.float32)
            for i, m in enumerate(weight_map_for(hf).mappings())]


def _layer_of_pair(bucket: list[PlanEntry]) -> list[str]:
    return [n.rsplit(".self_attn.", 1)[0] + ("/q" if "q_a_proj" in n else "/kv") for e in bucket
            for n in e.mapping.hf if "q_a_proj" in n or "kv_a_proj_with_mqa" in n]


@pytest.mark.parametrize("bucket_bytes", [1, 400, 1000, 2500, 10_000, 1 << 30])
def test_a_layers_fused_pair_is_never_cut(bucket_bytes):
    plan = _plan(deepseek_v3())
    out = buckets(plan, bucket_bytes)
    assert [e for b in out for e in b] == plan  # every entry once, in order
    halves = [_layer_of_pair(b) for b in out]
    for b in halves:
        layers = {h.split("/")[0] for h in b}
        assert all(f"{layer}/q" in b and f"{layer}/kv" in b for layer in layers), b
    assert sum(map(len, halves)) == 2 * 4  # 4 layers, both halves each


def test_buckets_are_bounded_otherwise():
    plan = _plan(qwen3_moe())
    for bucket_bytes in (1, 1000, 5000):
        out = buckets(plan, bucket_bytes)
        assert [e for b in out for e in b] == plan
        assert all(len(b) == 1 or sum(e.nbytes for e in b) <= bucket_bytes for b in out)
    assert len(buckets(plan, 1)) == len(plan)
