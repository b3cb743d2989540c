"""DeepSeek-V3 served by a real SGLang server on CPU: its log-probs against transformers (a shared
prefix from the radix cache, decoding beyond YaRN's original context), then a GSPO run of the main
job's task with routing replay (R3) against it: exit 0, the trainer's log-probs within 1e-4 of
SGLang's after every weight sync, every replayed route SGLang's.

SGLang 0.5.23 takes the MHA path for MLA at a prefill without a cached prefix
(models/deepseek_common/attention_backend_handler.py handle_attention_triton, which
torch_native falls back to), and the torch_native backend then attends over the KV cache, where
MLA keeps its latents, instead of the keys and values it is given: the CPU stand-in
(rollout/in_server/cpu_stand_ins/sitecustomize.py) sends torch_native to the absorbed MLA path at every step.
One server for the module (~30 s), started with --enable-return-routed-experts.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from family_checks import gspo_run_with_replay

pytestmark = pytest.mark.slow
# 256 positions, YaRN x4 over 64 original ones: the main job's prompts fit, and a row can pass 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model
    return make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("dsv3") / "hf", seed=0,
                           max_position_embeddings=256, rope_parameters=YARN, initializer_range=0.1)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from rollout.servers.launch import ServerConfig, ServerGroup
    with ServerGroup.launch(ServerConfig(model_path=str(model), device="cpu", startup_timeout_s=300,
                                         return_routed_experts=True,
                                         log_dir=str(tmp_path_factory.mktemp("dsv3_logs")))) as group:
        yield group.server_urls[0]


def _generate(url: str, prompts: list[list[int]], new: int) -> list[dict]:
    body = json.dumps({"input_ids": prompts, "return_logprob": True, "sampling_params": {
        "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


def test_sglang_log_probs_equal_transformers(model, server):
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 512, (60,), generator=g).tolist()  # + 24 new tokens: past position 64
    prompts = [long, [5, 9, 33], long[:40] + [7, 8]]
    outs = _generate(server, prompts[:2], 24) + _generate(server, prompts[2:], 24)  # from the cache
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    errs = []
    for prompt, out in zip(prompts, outs):
        served = out["meta_info"]["output_token_logprobs"]
        ids = prompt + [t for _, t, _ in served]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = lp[len(prompt) - 1:-1].gather(-1, torch.tensor(ids[len(prompt):])[:, None])[:, 0]
        errs.append(float((want - torch.tensor([v for v, _, _ in served])).abs().max()))
    cached = outs[2]["meta_info"].get("cached_tokens", 0)
    print(f"max |sglang - transformers| log-prob per prompt {errs}; cached prompt tokens {cached}")
    assert max(errs) < 1e-5
    assert cached > 0  # the absorbed path over a cached prefix was taken


def test_gspo_run_with_routing_replay(model, server, tmp_path):
    diff, mismatch = gspo_run_with_replay(model, server, tmp_path)
    assert all(d < 1e-4 for d in diff) and all(m == 0.0 for m in mismatch)
