"""The fused log-prob path's memory is flat in the number of tokens, and a chunk taken from the
memory budget (LogProbSettings.chunk_memory_mb, the actor's default) stays within it.

Measured as benchmarks/logprobs_memory.py does (one fresh process per run, peak RSS over the
inputs, minus the returned gradients = "work"). The straightforward path at the same size is the
control: it grows with the tokens, so the measurement can see growth. Exactness is
tests/actor/test_logprobs.py (values and gradients to 1e-5 of a dense log_softmax).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from script_modules import load_script

MiB = 2**20
V, H = 32768, 256


def _work(path: str, tokens: int, chunk_tokens: int, chunk_memory_mb: int = 1024) -> float:
    measure_once = load_script("benchmarks/logprobs_memory.py").measure_once
    args = SimpleNamespace(hidden=H, dtype="fp32", device="cpu", chunk_tokens=chunk_tokens,
                           chunk_memory_mb=chunk_memory_mb, no_skip=True)
    r = measure_once(path, tokens, V, args)
    assert isinstance(r, dict), r
    return (r["peak"] - r["grads"]) / MiB


@pytest.mark.slow
def test_fused_memory_is_flat_in_tokens_and_within_its_budget():
    chunk = 256  # [256, 32768] fp32 = 32 MiB per chunk tensor
    small, large = _work("fused", 1024, chunk), _work("fused", 8192, chunk)
    straight = _work("straightforward", 8192, chunk)   # [8192, 32768] fp32 = 1 GiB per tensor
    print(f"work MiB: fused 1k {small:.0f}, fused 8k {large:.0f}, straightforward 8k {straight:.0f}")
    assert straight > 1024, "the measurement does not see the straightforward path's logits"
    assert large < small + 48, "fused memory grows with the tokens"  # O(t) scalars: 8k x 16 B
    # The chunk from the budget: 128 MiB / (32768 x 4 B x 2) = 512 tokens; the peak work stays
    # within the budget (plus the [t] scalars and the allocator's slack).
    budget = _work("fused", 8192, 0, chunk_memory_mb=128)
    print(f"work MiB with chunk_memory_mb=128: {budget:.0f}")
    assert budget < 128 * 1.25
