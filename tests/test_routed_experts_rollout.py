"""Routing replay data from the rollout side: SGLang's routed experts per token, parsed by the client
and kept per Sample (rollout/sample.py documents the layout and what SGLang returns).

Hand-made /generate replies check the parsing and its errors; a real SGLang server on CPU
(tiny Qwen3-MoE, --enable-return-routed-experts, behind sglang-router) checks the shape, the prefix
cache, partial-rollout resumes through the manager and its checkpoint, and multi-turn episodes,
against the router top-k of a transformers forward."""
from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest

from rollout.client import SGLangError, parse_generate_item, routed_experts_layout_of
from rollout.manager import ManagerConfig, RolloutManager
from rollout.sample import Sample

URL = "http://test"


def _item(prompt_tokens, output_ids, routing=None, finish="length"):
    meta = {"prompt_tokens": prompt_tokens, "finish_reason": {"type": finish},
            "weight_version": "default",
            "output_token_logprobs": [[-1.0, t, None] for t in output_ids]}
    if routing is not None:
        meta["routed_experts"] = base64.b64encode(np.asarray(routing, "<i4").tobytes()).decode()
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta}


def _routing(rows, layers=3, k=2, seed=0):
    return np.random.default_rng(seed).integers(0, 8, (rows, layers, k)).astype(np.int32)


# --- parsing -------------------------------------------------------------------------------------
def test_parse_good_reply():
    r = _routing(5 + 4 - 1)
    out = parse_generate_item(_item(5, [1, 2, 3, 4], r), URL, (3, 2))
    assert out.routed_experts.dtype == np.int16 and out.routed_experts.shape == (8, 3, 2)
    np.testing.assert_array_equal(out.routed_experts, r)
    # not requested: not decoded even when present
    assert parse_generate_item(_item(5, [1, 2, 3, 4], r), URL).routed_experts is None


def test_parse_missing_routing_is_a_clear_error_unless_aborted():
    with pytest.raises(SGLangError, match="no meta_info.routed_experts.*--enable-return-routed-experts"):
        parse_generate_item(_item(5, [1, 2]), URL, (3, 2))
    # a request aborted before it ran comes back without it (the sample is generated again)
    assert parse_generate_item(_item(5, [], finish="abort"), URL, (3, 2)).routed_experts is None


@pytest.mark.parametrize("rows", [5 + 2, 5 + 2 - 2])
def test_parse_wrong_size_names_the_expected_size(rows):
    with pytest.raises(SGLangError, match=r"has \d+ bytes, expected 144 = 6 rows .* 3 layers x top-2"):
        parse_generate_item(_item(5, [1, 2], _routing(rows)), URL, (3, 2))
    with pytest.raises(SGLangError, match="not base64"):
        item = _item(5, [1, 2], _routing(6))
        item["meta_info"]["routed_experts"] = "@@not base64@@"
        parse_generate_item(item, URL, (3, 2))


def test_layout_from_hf_config():
    assert routed_experts_layout_of({"num_hidden_layers": 48, "num_experts_per_tok": 8}) == (48, 8)
    assert routed_experts_layout_of({"text_config": {"num_hidden_layers": 4,
                                                     "num_experts_per_tok": 2}}) == (4, 2)
    with pytest.raises(ValueError, match="MoE"):
        routed_experts_layout_of({"num_hidden_layers": 4})


def test_server_flag():
    from rollout.server import ServerConfig, server_process
    import pathlib
    cmd = server_process(ServerConfig("/m", device="cpu", return_routed_experts=True), pathlib.Path("/tmp")).cmd
    assert cmd.count("--enable-return-routed-experts") == 1
    assert "--enable-return-routed-experts" not in server_process(ServerConfig("/m", device="cpu"),
                                                                  pathlib.Path("/tmp")).cmd


# --- the Sample record ---------------------------------------------------------------------------
def test_sample_keeps_routing_aligned_with_tokens():
    s = Sample(0, 0, {}, [7, 8, 9], max_new_tokens=20)
    s.append_model_tokens([1, 2], [-1.0, -1.0], ["v", "v"], _routing(4))
    assert s.routed_experts.shape == (5, 3, 2) and (s.routed_experts[-1] == -1).all()
    s.append_env_tokens([3, 4, 5])  # environment tokens: not routed (yet)
    assert s.routed_experts.shape == (8, 3, 2) and (s.routed_experts[4:] == -1).all()
    s.check_aligned()
    with pytest.raises(ValueError, match=r"expected \[9, layers, top-k\]"):
        s.append_model_tokens([6, 7], [-1.0, -1.0], ["v", "v"], _routing(8))
    # the next call had the whole sequence as input: it fills the rows no earlier call covered
    # (the environment tokens and the last sampled token), the earlier call's rows stay: a route
    # belongs to the call (the weight version) that generated the token it predicts
    before = s.routed_experts.copy()
    new = _routing(9, seed=1)
    s.append_model_tokens([6, 7], [-1.0, -1.0], ["v", "v"], new)
    assert s.routed_experts.shape == (10, 3, 2)
    np.testing.assert_array_equal(s.routed_experts[:4], before[:4])
    np.testing.assert_array_equal(s.routed_experts[4:9], new[4:9])
    # a call that came back without routing (aborted early) pads; the older rows stay
    s.append_model_tokens([], [], [], None)
    s.append_model_tokens([9], [-1.0], ["v"], None)
    assert s.routed_experts.shape == (11, 3, 2) and (s.routed_experts[9:] == -1).all()
    s.check_aligned()
    s.routed_experts = s.routed_experts[:-1]
    with pytest.raises(AssertionError, match="routed-experts rows"):
        s.check_aligned()
    # never requested: stays None
    t = Sample(0, 1, {}, [7], max_new_tokens=4)
    t.append_model_tokens([1], [-1.0], ["v"])
    t.append_env_tokens([2])
    assert t.routed_experts is None


def test_sample_and_buffer_json_round_trip():
    s = Sample(3, 1, {"prompt": "p"}, [7, 8, 9], max_new_tokens=20)
    s.append_model_tokens([1, 2], [-0.5, -0.25], ["v", "v"], _routing(4))
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.routed_experts.dtype == np.int16
    np.testing.assert_array_equal(back.routed_experts, s.routed_experts)
    other = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    other.routed_experts[0, 0, 0] += 1
    assert other != s
    # checkpoints written before routing replay have no such key
    old = s.to_dict()
    del old["routed_experts"]
    assert Sample.from_dict(old).routed_experts is None
    # the manager's rollout buffer (driver.json) keeps it
    mgr = RolloutManager(None, ManagerConfig(), encode_prompt=lambda r: [1], decode=str,
                         reward_fn=lambda r, t: 0.0)
    mgr.buffer.append([s, Sample(3, 0, {"prompt": "p"}, [7, 8, 9], 20)])
    mgr2 = RolloutManager(None, ManagerConfig(), encode_prompt=lambda r: [1], decode=str,
                          reward_fn=lambda r, t: 0.0)
    mgr2.load_state(json.loads(json.dumps(mgr.to_state())))
    assert list(mgr2.buffer) == list(mgr.buffer)
    for m in (mgr, mgr2):
        m.close()


def test_manager_requests_routing_only_when_configured():
    assert ManagerConfig().generate_kwargs() == {}
    assert ManagerConfig(return_routed_experts=True).generate_kwargs() == {"return_routed_experts": True}


# --- a real SGLang server on CPU -----------------------------------------------------------------
@pytest.fixture(scope="module")
def routing_server():
    from fixtures_models import tiny_model_dir
    from rollout.server import ServerConfig, ServerGroup
    config = ServerConfig(model_path=str(tiny_model_dir("qwen3_moe", 0)), device="cpu",
                          return_routed_experts=True, startup_timeout_s=300)
    with ServerGroup.launch(config, router=True) as group:
        yield group


_HF: dict = {}


def _hf_topk(tokens):
    """transformers' router top-k sets [n, layers, k] (sorted) and each one's margin to the next."""
    import torch
    import transformers
    from fixtures_models import tiny_model_dir
    if "model" not in _HF:
        _HF["model"] = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir("qwen3_moe", 0), dtype=torch.float32).eval()
    model = _HF["model"]
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    top = torch.stack([x.reshape(len(tokens), -1).topk(k + 1, dim=-1).values for x in logits], 1)
    sets = torch.stack([x.reshape(len(tokens), -1).topk(k, dim=-1).indices for x in logits], 1)
    return sets.sort(-1).values.numpy(), (top[..., k - 1] - top[..., k]).numpy()


def _check_against_hf(sample: Sample):
    """Every position but the last routed as transformers routes it (near-ties excepted); last = -1."""
    r = sample.routed_experts
    assert r.shape == (len(sample.tokens), 2, 2) and r.dtype == np.int16
    assert (r[-1] == -1).all() and ((r[:-1] >= 0) & (r[:-1] < 4)).all()
    sets, margin = _hf_topk(sample.tokens[:-1])
    differ = (np.sort(r[:-1], -1) != sets).any(-1)
    assert (margin[differ] < 1e-4).all(), f"{int(differ.sum())} routings differ from transformers"


@pytest.mark.slow
def test_routing_shape_and_prefix_cache(routing_server):
    from rollout.client import SGLangClient
    client = SGLangClient(routing_server.server_urls[0])
    prompt = list(range(20, 60))
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    first = client.generate(prompt, params, return_routed_experts=True)[0]
    assert first.routed_experts.shape == (len(prompt) + 8 - 1, 2, 2)
    assert ((first.routed_experts >= 0) & (first.routed_experts < 4)).all()
    # the same prompt again: served from the radix cache, routed identically
    payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
               "logprob_start_len": -1, "return_routed_experts": True}
    item = client._json("POST", "/generate", payload)
    assert item["meta_info"]["cached_tokens"] == len(prompt) - 1
    second = parse_generate_item(item, client.url, (2, 2))
    np.testing.assert_array_equal(second.routed_experts[:len(prompt)], first.routed_experts[:len(prompt)])
    s = Sample(0, 0, {}, prompt, 8)
    s.append_model_tokens(first.output_ids, first.logprobs, first.weight_versions, first.routed_experts)
    _check_against_hf(s)


@pytest.mark.slow
def test_partial_rollout_resume_through_the_manager_and_its_checkpoint(routing_server):
    import transformers
    from fixtures_models import tiny_model_dir
    from rollout.dataset import chat_prompt_ids
    from rollout.pool import ServerPool

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))

    def manager():  # through the router: routed-experts requests go to the servers directly
        return RolloutManager(ServerPool(routing_server.server_urls, routing_server.router_url), cfg,
                              encode_prompt=lambda rec: chat_prompt_ids(tok, rec), decode=tok.decode,
                              reward_fn=lambda rec, text: float(len(text) % 2))

    budget = 96
    cfg = ManagerConfig(group_size=2, max_new_tokens=budget, partial_rollouts=True, ignore_eos=True,
                        oversample_groups=2, return_routed_experts=True)
    mgr = manager()
    prompts = iter([{"prompt": "short", "answer": "0", "max_new_tokens": 4},
                    {"prompt": "long a", "answer": "0"}, {"prompt": "long b", "answer": "0"}])
    step1 = mgr.generate_step(prompts, num_groups=1)
    for s in step1.groups[0]:
        s.check_aligned()
        _check_against_hf(s)
    partial = [s for g in mgr.buffer for s in g]
    assert partial and all(s.finish_reason == "abort" and s.remaining_tokens > 0 for s in partial)
    for s in partial:  # routed up to what the aborted call processed, or not at all if it never ran
        s.check_aligned()
    state = json.loads(json.dumps(mgr.to_state()))
    mgr.close()
    mgr = manager()
    mgr.load_state(state)
    step2 = mgr.generate_step(iter([]), num_groups=2)
    assert step2.metrics["samples_resumed"] >= 1
    for g in step2.groups:
        for s in g:
            s.check_aligned()
            assert len(s.response_ids) == budget
            _check_against_hf(s)  # the resumed call covered the prompt and the earlier segment
    mgr.close()


class _TwoTurnEnv:
    max_turns = 3

    def reset(self, prompt):
        return "guess a number"

    def step(self, model_turn):
        from rollout.multiturn import EnvStep
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep("higher", 0.5, done=self.turns >= 2)


@pytest.mark.slow
def test_multi_turn_episode_routes_env_tokens_of_earlier_turns(routing_server):
    import transformers
    from fixtures_models import tiny_model_dir
    from rollout.multiturn import run_episode
    from rollout.pool import ServerPool

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))
    pool = ServerPool(routing_server.server_urls)
    cfg = ManagerConfig(max_turn_tokens=6, ignore_eos=True, return_routed_experts=True)
    counter = iter(range(100))
    s = run_episode(Sample(0, 0, {}, [], 40), _TwoTurnEnv(), pool, cfg, tok.decode,
                    lambda text: tok.encode(text, add_special_tokens=False),
                    lambda smp: f"turn-{next(counter)}")
    kinds = [kind for kind, _, _ in s.metadata["spans"]]
    assert kinds == ["model", "env", "model"] and s.finish_reason == "env_done"
    s.check_aligned()
    _check_against_hf(s)  # env tokens of turn 1 were input to turn 2: routed; only the last is -1
    # the middle of an episode: env tokens appended after the last model turn are -1
    mid = Sample(0, 1, {}, list(s.prompt_ids), 40)
    out = pool.generate(mid.tokens, cfg.sampling_params(6), return_routed_experts=True)
    mid.append_model_tokens(out.output_ids, out.logprobs, out.weight_versions, out.routed_experts)
    mid.append_env_tokens([5, 6, 7])
    assert (mid.routed_experts[-4:] == -1).all() and (mid.routed_experts[:-4] >= 0).all()
    pool.close()


@pytest.mark.slow
def test_aborted_request_keeps_what_it_processed(routing_server):
    from rollout.client import SGLangClient
    client = SGLangClient(routing_server.server_urls[0])
    prompt, result = list(range(30, 50)), {}

    def run():
        result["out"] = client.generate(prompt, {"max_new_tokens": 3000, "ignore_eos": True},
                                        rid="routing-abort", return_routed_experts=True)[0]

    thread = threading.Thread(target=run)
    thread.start()
    import time
    time.sleep(3)
    client.abort("routing-abort")
    thread.join(120)
    out = result["out"]
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 3000
    assert out.routed_experts.shape == (len(prompt) + len(out.output_ids) - 1, 2, 2)


# --- acceptance (issue 12): with replay on, megatron routes every trained token as SGLang did -----
def _actor_on_batch(rank, world, layout, batch, hf_dir, weights):
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings, RoutingSettings
    from gspo_megatron.parallel.layout import ParallelLayout

    actor = Actor(hf_dir, ParallelLayout(**layout), batching=MicroBatchSettings(micro_batch_size=3),
                  routing=RoutingSettings(replay=True, drift=False))
    actor.load_weights(weights)
    shard = actor.shard(batch)
    log_probs, metrics = actor.compute_old_log_probs(shard)
    keeps = actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
    return dict(metrics=metrics, old=(shard.global_rows.numpy(), log_probs.numpy()) if keeps else None)


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [({}, 1), ({"tensor": 2}, 2), ({"expert": 2}, 2)],
                         ids=["one_process", "tp2", "ep2"])
def test_replay_routes_every_trained_token_as_sglang(routing_server, layout, world, tmp_path):
    from distributed import gather_row_values, run_distributed
    from fixtures_models import tiny_model_dir
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.rollout_batch import samples_to_batch
    from rollout.pool import ServerPool

    pool = ServerPool(routing_server.server_urls, routing_server.router_url)
    groups = []
    for g in range(3):  # 3 prompts x 2 samples, 12-20 new tokens, temperature 1
        group = []
        for i in range(2):
            s = Sample(g, i, {}, list(range(30 + 7 * g, 45 + 9 * g)), 12 + 4 * g)
            out = pool.generate(s.tokens, {"max_new_tokens": s.max_new_tokens, "temperature": 1.0,
                                           "ignore_eos": True}, return_routed_experts=True)
            s.append_model_tokens(out.output_ids, out.logprobs, out.weight_versions, out.routed_experts)
            s.reward = float(i)
            group.append(s)
        groups.append(group)
    pool.close()
    batch = samples_to_batch(groups, group_size=2)
    trained = int(batch.loss_mask.sum())
    weights = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "mcore")
    results = run_distributed(_actor_on_batch, world, (layout, batch, str(tiny_model_dir("qwen3_moe", 0)), str(weights)),
                              timeout=300)
    m = results[0]["metrics"]
    # every trained token at both MoE layers, replayed to exactly SGLang's experts
    assert m["routing_replay_mismatch_sets"] == 2 * trained and m["routing_replay_mismatch"] == 0.0
    # megatron's own choice agrees with SGLang's (same fp32 weights) but for near-ties
    assert m["routing_engine_mismatch"] < 0.02
    got = gather_row_values([r["old"] for r in results], batch.num_rows, batch.tokens.shape[1])
    diff = (got - batch.rollout_log_probs)[batch.loss_mask].abs().max()
    assert float(diff) < 1e-3, "replayed megatron log-probs should match SGLang's"
