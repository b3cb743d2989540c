"""Routing replay data from the rollout side: SGLang's routed experts per token, parsed by the client
and kept per Sample (rollout/generation/sample.py documents the layout and what SGLang returns).

A real SGLang server on CPU (tiny Qwen3-MoE, --enable-return-routed-experts, behind
sglang-router) checks the shape, the prefix cache, partial-rollout resumes through the manager and
its checkpoint, and multi-turn episodes, against the router top-k of a transformers forward; and
the actor replaying its routes (one process, EP2, DP2 x PP2). The parsing of hand-made replies and
the Sample record: test_client_routed_experts.py."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from rollout.servers.client import parse_generate_item
from rollout.generation.manager import ManagerConfig, RolloutManager
from rollout.generation.sample import Sample


# --- a real SGLang server on CPU -----------------------------------------------------------------
@pytest.fixture(scope="module")
def routing_server():
    from fixtures_models import tiny_model_dir
    from rollout.servers.launch import ServerConfig, ServerGroup
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
    assert r is not None and r.shape == (len(sample.tokens), 2, 2) and r.dtype == np.int16
    assert (r[-1] == -1).all() and ((r[:-1] >= 0) & (r[:-1] < 4)).all()
    sets, margin = _hf_topk(sample.tokens[:-1])
    differ = (np.sort(r[:-1], -1) != sets).any(-1)
    assert (margin[differ] < 1e-4).all(), f"{int(differ.sum())} routings differ from transformers"


@pytest.mark.slow
def test_routing_shape_and_prefix_cache(routing_server):
    from rollout.servers.client import SGLangClient
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
    from rollout.prompts.dataset import chat_prompt_ids
    from rollout.servers.pool import ServerPool

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
    partial = [s for g in mgr.groups.buffer for s in g]
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
        from rollout.generation.multiturn import EnvStep
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep("higher", 0.5, done=self.turns >= 2)


@pytest.mark.slow
def test_multi_turn_episode_routes_env_tokens_of_earlier_turns(routing_server):
    import transformers
    from fixtures_models import tiny_model_dir
    from rollout.generation.multiturn import run_episode
    from rollout.servers.pool import ServerPool

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
    from rollout.servers.client import SGLangClient
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


# --- with replay on, megatron routes every trained token as SGLang did,
# and DP2 x PP2 (each stage receiving only its own layer's routes) trains as one process -----------
STEPS = 3


def _actor_on_batch(rank, world, layout, batch, hf_dir, weights, steps):
    """The trainer's path: rank 0 sends each rank its rows (transfer.scatter_rows, packed, its
    stage's routing layers); pi_old with replay, then `steps` x (pi_old, 2 mini-batch updates)."""
    import torch
    from megatron.core import parallel_state as ps

    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings, OptimizerSettings, RoutingSettings
    from gspo_megatron.parallel.layout import ParallelLayout

    actor = Actor(hf_dir, ParallelLayout(**layout), batching=MicroBatchSettings(micro_batch_size=3),
                  optimizer=OptimizerSettings(optimizer="adam", lr=0.1, adam_eps=10.0, clip_grad=0.0),
                  routing=RoutingSettings(replay=True, drift=False), seed=5)
    actor.load_weights(weights)
    keeps = actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
    out = dict(held=[], layers=None, updates=[], old=[], metrics=None)
    for step in range(steps + 1):
        shard, _, _ = actor.receive_rows(rank, lambda: (batch, None), num_mini_batches=2)
        assert shard.is_packed and shard.routed_experts.dtype == torch.uint8
        out["held"].append((shard.nbytes(), int(shard.lengths.sum())))
        out["layers"] = shard.route_layers
        shard.old_log_probs, metrics = actor.compute_old_log_probs(shard)
        out["metrics"] = out["metrics"] or metrics
        if keeps:
            out["old"].append((shard.global_rows.numpy(), shard.padded().old_log_probs.numpy()))
        if step < steps:
            out["updates"].append([actor.train_step(mini) for mini in shard.mini_batches()])
    return out


def _sampled_batch(routing_server):
    from gspo_megatron.driver.samples_to_batch import samples_to_batch
    from rollout.servers.pool import ServerPool

    pool = ServerPool(routing_server.server_urls, routing_server.router_url)
    groups = []
    for g in range(4):  # 4 prompts x 2 samples, 12-24 new tokens, temperature 1, skewed prompts
        group = []
        for i in range(2):
            s = Sample(g, i, {}, list(range(30 + 7 * g, 45 + 9 * g * g)), 12 + 4 * g)
            out = pool.generate(s.tokens, {"max_new_tokens": s.max_new_tokens, "temperature": 1.0,
                                           "ignore_eos": True}, return_routed_experts=True)
            s.append_model_tokens(out.output_ids, out.logprobs, out.weight_versions, out.routed_experts)
            s.reward = float(i + g % 2)
            group.append(s)
        groups.append(group)
    pool.close()
    return samples_to_batch(groups, group_size=2)


def _replayed_as_sglang(results, batch):
    from distributed import gather_row_values
    m = results[0]["metrics"]
    trained = int(batch.loss_mask.sum())
    # every trained token at both MoE layers, replayed to exactly SGLang's experts
    assert m["routing_replay_mismatch_sets"] == 2 * trained and m["routing_replay_mismatch"] == 0.0
    # megatron's own choice agrees with SGLang's (same fp32 weights) but for near-ties
    assert m["routing_engine_mismatch"] < 0.02
    padded = batch.padded()
    got = gather_row_values([r["old"][0] if r["old"] else None for r in results], batch.num_rows,
                            padded.tokens.shape[1])
    diff = (got - padded.rollout_log_probs)[padded.loss_mask].abs().max()
    assert float(diff) < 1e-3, "replayed megatron log-probs should match SGLang's"
    return got


@pytest.mark.slow
def test_replay_routes_every_trained_token_as_sglang_ep2(routing_server, tmp_path):
    from distributed import run_distributed
    from fixtures_models import tiny_model_dir
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    batch = _sampled_batch(routing_server)
    weights = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "mcore")
    results = run_distributed(_actor_on_batch, 2, ({"expert": 2}, batch, str(tiny_model_dir("qwen3_moe", 0)),
                                                    str(weights), 0), timeout=300)
    _replayed_as_sglang(results, batch)


@pytest.mark.slow
def test_replay_dp2_pp2_trains_as_one_process(routing_server, tmp_path):
    """DP2 x PP2 with routing replay on SGLang's routes: each stage receives its own layer's routes
    only (one byte per expert id and real token) and the rows of its replica; pi_old matches
    SGLang's log-probs, and after 3 steps of 2 updates the losses, gradient norms and log-probs
    equal one process within 1e-5 (gradient norms: or 1e-6 relative)."""
    from distributed import gather_row_values, run_distributed
    from fixtures_models import tiny_model_dir
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    batch = _sampled_batch(routing_server)
    hf = str(tiny_model_dir("qwen3_moe", 0))
    weights = str(convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "mcore"))
    one = run_distributed(_actor_on_batch, 1, ({}, batch, hf, weights, STEPS), timeout=300)
    four = run_distributed(_actor_on_batch, 4, ({"pipeline": 2}, batch, hf, weights, STEPS), timeout=420)
    _replayed_as_sglang(one, batch)
    _replayed_as_sglang(four, batch)
    assert one[0]["layers"] is None or one[0]["layers"] == [0, 1]
    assert sorted(r["layers"] == [0] for r in four) == [False, False, True, True]  # 2 stages x DP2
    for r in four:  # what a rank holds: its rows' real tokens x (fields + its one layer's routes)
        for nbytes, real in r["held"]:
            per_token = 8 + 1 + 4 + 8 + 1 * 2  # tokens, mask, rollout log-probs, versions, 1 layer x top-2
            assert nbytes <= real * per_token + 8 * 3 * 4, (nbytes, real)
    width = batch.padded().tokens.shape[1]
    mask = batch.padded().loss_mask
    for step in range(STEPS + 1):
        a = gather_row_values([one[0]["old"][step]], batch.num_rows, width)
        b = gather_row_values([r["old"][step] if r["old"] else None for r in four], batch.num_rows, width)
        assert float((a - b)[mask].abs().max()) <= 1e-5, f"log-probs after {step} steps"
    for step in range(STEPS):
        for mine, ref in zip(four[0]["updates"][step], one[0]["updates"][step]):
            for key in ("loss", "grad_norm"):
                # relative too: the sampled batch's gradient norm can reach the hundreds, where
                # 1e-5 is below fp32's resolution (DP2 x PP2 sums in another order: 254.82870 vs
                # 254.82864 seen)
                assert mine[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-5), (step, key)
