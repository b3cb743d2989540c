"""The benchmarks measure what their rows say.

On an H100 benchmarks/mfu.py printed 0.0% padding for every configuration, "rows in
order x4" included: packing left at null is on wherever the TE spec runs on CUDA, so every CUDA
row was packed. Each configuration now says whether it packs; here its batching is resolved the
way the Actor resolves it on a CUDA + TE machine (bf16, TE 2.20.2).
"""
from __future__ import annotations

import pytest
from script_modules import load_script

from gspo_megatron.actor.batching.packing import resolve_packing
from gspo_megatron.actor.settings import MicroBatchSettings

mfu = load_script("benchmarks/mfu.py")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_configuration_packs_exactly_when_its_name_says(device):
    configs = mfu.configurations(device)
    packed = []
    for name, _, batching, _ in configs:
        requested = MicroBatchSettings(**batching).pack_sequences
        on_gpu = resolve_packing(requested, te_on_cuda=device == "cuda", context=1, half=True,
                                 te_version="2.20.2")
        assert on_gpu == ("packed" in name), (name, batching)
        packed.append(on_gpu)
    assert any(packed) == (device == "cuda")
    assert not packed[0]  # "before" pads its rows


def test_flops_count_real_tokens_only():
    hf = mfu.QWEN3_30B_LAYERS
    assert mfu.train_flops(hf, [100, 200]) == pytest.approx(
        6.0 * mfu.active_params(hf) * 300 + 6 * 8 * 32 * 128 * (100 ** 2 + 200 ** 2))
