"""Qwen3-Next served by a real SGLang server on CPU: its log-probs against transformers (prompts
past the 64-token chunk of the delta rule, a prefix from the radix cache that resumes from the
cached DeltaNet states), then a GSPO run of the main job's task with routing replay (R3) against
it: exit 0, the trainer's log-probs within 1e-4 of SGLang's after every weight sync, every replayed
route SGLang's.

SGLang 0.5.23 runs Qwen3-Next on a CPU with sgl-kernel's CPU ops (AMX / AVX-512 builds only): the
CPU stand-ins (rollout/in_server/cpu_stand_ins/gdn_ops.py, sitecustomize.py) give it torch forms of them and
of its gated norm, resolve its Mamba radix cache to no_buffer, read transformers 5's layer_types,
and keep the conv states in float32. One server for the module.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from family_checks import gspo_run_with_replay

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model
    return make_tiny_model("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "hf", seed=0,
                           initializer_range=0.1)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from rollout.servers.launch import ServerConfig, ServerGroup
    # the DeltaNet state cache: 64 sequences' conv and recurrent states, not SGLang's default of
    # 1.75 GB for this model
    with ServerGroup.launch(ServerConfig(model_path=str(model), device="cpu", startup_timeout_s=300,
                                         return_routed_experts=True,
                                         extra_args=("--max-mamba-cache-size", "64"),
                                         log_dir=str(tmp_path_factory.mktemp("q3n_logs")))) as group:
        yield group.server_urls[0]


def _generate(url: str, prompts: list[list[int]], new: int, start: int = 0) -> list[dict]:
    body = json.dumps({"input_ids": prompts, "return_logprob": True, "logprob_start_len": start,
                       "sampling_params": {"max_new_tokens": new, "temperature": 1.0,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


def test_sglang_log_probs_equal_transformers(model, server):
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 512, (90,), generator=g).tolist()  # past the 64-token chunk
    outs = _generate(server, [long, [5, 9, 33]], 16)
    # the long prompt and its continuation again: the radix cache resumes from its states (log-probs
    # of the last prompt tokens only: from position 0 SGLang would compute the prompt again)
    again = long + [t for _, t, _ in outs[0]["meta_info"]["output_token_logprobs"]] + [7, 8]
    outs += _generate(server, [again], 8, start=len(again) - 4)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    errs = []
    for prompt, out in zip([long, [5, 9, 33], again], outs):
        served = out["meta_info"]["input_token_logprobs"][1:] + out["meta_info"]["output_token_logprobs"]
        ids = prompt + [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor([v for v, _, _ in served])
        errs.append(float((want[-len(got):] - got).abs().max()))
    cached = outs[2]["meta_info"].get("cached_tokens", 0)
    print(f"max |sglang - transformers| log-prob per prompt {errs}; cached prompt tokens {cached}")
    assert max(errs) < 1e-4 and cached > 0  # the project's mismatch bound (fp32); the cache taken


def test_gspo_run_with_routing_replay(model, server, tmp_path):
    diff, mismatch = gspo_run_with_replay(model, server, tmp_path)
    assert all(d < 1e-4 for d in diff) and all(m == 0.0 for m in mismatch)
