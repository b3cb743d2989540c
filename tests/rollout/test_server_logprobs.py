"""SGLang's returned log-probs equal a transformers forward on the same tiny model (1e-4)."""
from __future__ import annotations

import random

import pytest

from fixtures_models import hf_response_logprobs, tiny_model_dir
from rollout.servers.pool import ServerPool

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch,fixture", [("qwen3", "qwen3_server"), ("qwen3_moe", "moe_server")])
def test_sglang_logprobs_match_transformers(arch, fixture, request):
    group = request.getfixturevalue(fixture)
    pool = ServerPool(group.server_urls)
    rng = random.Random(0)
    worst = 0.0
    for n_prompt in (1, 7, 30):
        prompt = [rng.randrange(3, 512) for _ in range(n_prompt)]
        out = pool.generate(prompt, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True})
        assert len(out.output_ids) == len(out.logprobs) == 24
        ref = hf_response_logprobs(tiny_model_dir(arch, 0), prompt, out.output_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, ref)))
    assert worst < 1e-4, f"{arch}: max |sglang - transformers| log-prob = {worst:.3g}"
    print(f"{arch}: max |sglang - transformers| = {worst:.3g}")
