"""Routes, tokens, engine log-probs and weight versions stay paired through SGLang's pauses,
retracts and aborts and the project's resumes, and routing replay recomputes pi_old per version as
the engine computed it (rollout/in_server/released_routes.py, rollout/generation/alignment.py,
gspo_megatron/actor/held/versioned_routes.py).

One real SGLang server on CPU for the module (the tiny Qwen3-MoE, routes returned, a KV cache of
256 tokens). A weight sync here is `update_weights_from_disk` to "v2": the same model with every
router's expert rows rotated by one, so that every top-k set of the first layer changes and the
tokens after it are routed differently. Each route is compared with transformers' router top-k
under the weights of the version whose forward computed it (that of the first model token after
its position), each engine log-prob with transformers' log-prob under its token's version.
"""
from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rollout.generation.alignment import misalignment
from rollout.generation.manager import ManagerConfig, RolloutManager
from rollout.generation.multiturn import Environment
from rollout.generation.sample import Sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    from fixtures_models import tiny_model_dir
    from rollout.servers.launch import ServerConfig, ServerGroup
    # SGLang admits a request without ignore_eos on an estimate of its length scaled by the
    # conservativeness: a small one over-commits the KV cache at once (the pressure test); a
    # request with ignore_eos reserves its whole budget whatever it is (SchedulePolicy's
    # add_one_req_ignore_eos)
    config = ServerConfig(model_path=str(tiny_model_dir("qwen3_moe", 0)), device="cpu",
                          return_routed_experts=True, max_total_tokens=256, startup_timeout_s=300,
                          extra_args=["--schedule-conservativeness", "0.1"])
    with ServerGroup.launch(config) as group:
        yield group


@pytest.fixture(scope="module")
def versions(tmp_path_factory, server):
    """{"1": seed-0 tiny MoE, "2": the same with its routers' expert rows rotated}; the server
    serves "1" after every test."""
    from safetensors.torch import load_file, save_file

    from fixtures_models import tiny_model_dir
    from rollout.servers.client import SGLangClient
    v1 = tiny_model_dir("qwen3_moe", 0)
    v2 = tmp_path_factory.mktemp("routes-v2")
    shutil.copytree(v1, v2, dirs_exist_ok=True)
    weights = load_file(v1 / "model.safetensors")
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = torch.roll(weights[name], 1, dims=0).contiguous()
    save_file(weights, str(v2 / "model.safetensors"), metadata={"format": "pt"})
    dirs = {"1": str(v1), "2": str(v2)}
    SGLangClient(server.server_urls[0]).update_weights_from_disk(dirs["1"], weight_version="1")
    yield dirs
    SGLangClient(server.server_urls[0]).update_weights_from_disk(dirs["1"], weight_version="default")


_HF: dict = {}


def _hf(path: str, tokens: list[int]):
    """transformers under `path`'s weights: router top-k sets [n, layers, k] (sorted), each set's
    margin to the next expert [n, layers], and log p(tokens[p + 1] | tokens[:p + 1]) [n - 1]."""
    import transformers
    if path not in _HF:
        _HF[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, ids = _HF[path], torch.tensor([tokens])
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = [x.reshape(len(tokens), -1) for x in out.router_logits]
    top = torch.stack([x.topk(k + 1, dim=-1).values for x in logits], 1)
    sets = torch.stack([x.topk(k, dim=-1).indices for x in logits], 1).sort(-1).values
    logp = torch.log_softmax(out.logits[0].float(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return sets.numpy(), (top[..., k - 1] - top[..., k]).numpy(), logp.numpy()


def _route_version(sample: Sample) -> list[str | None]:
    """Per input position: the version of the first model token after it (whose forward computed
    the route there), None for the final position."""
    out: list[str | None] = [None] * len(sample.tokens)
    after: str | None = None
    prompt = len(sample.prompt_ids)
    for p in range(len(sample.tokens) - 2, -1, -1):
        if p + 1 >= prompt and sample.weight_versions[p + 1 - prompt]:
            after = sample.weight_versions[p + 1 - prompt]
        out[p] = after
    return out


def _paired(sample: Sample, dirs: dict[str, str], log_probs: bool = True) -> dict[str, tuple[int, int]]:
    """Checks the sample is aligned and (log_probs) that each engine log-prob is its token's
    version's; returns per version (rows whose routes are transformers' top-k under that version's
    weights, near-ties aside; rows), over the rows whose next token that version sampled, and
    "context" for the other rows (prompt, environment tokens: the next model token's version)."""
    assert misalignment(sample) is None, misalignment(sample)
    assert sample.routed_experts is not None
    prompt, rows = len(sample.prompt_ids), np.sort(sample.routed_experts, -1)
    where = _route_version(sample)
    counts: dict[str, list[int]] = {}
    for v in sorted({v for v in where if v}):
        sets, margin, logp = _hf(dirs[v], sample.tokens)
        for p in (p for p, pv in enumerate(where) if pv == v):
            same = (rows[p] == sets[p]).all(-1)
            sampled = p + 1 >= prompt and sample.weight_versions[p + 1 - prompt] == v
            key = v if sampled else "context"
            counts.setdefault(key, [0, 0])[1] += 1
            counts[key][0] += bool(same.all() or (margin[p][~same] < 1e-4).all())
        mine = [t for t, tv in enumerate(sample.weight_versions) if tv == v]
        if log_probs and mine:  # the engine's log-prob of a token is that of its version (TIS/MIS)
            diff = np.abs(np.array(sample.logprobs)[mine] - logp[prompt - 1 + np.array(mine)])
            assert diff.max() < 1e-5, (v, float(diff.max()))
    return {v: (a, b) for v, (a, b) in counts.items()}


def _wait_in_log(server, text: str, more: int, timeout_s: float = 120.0) -> None:
    """Until the server's log holds `more` more lines with `text` than now."""
    log = server.servers[0].log_path
    start = log.read_text(errors="replace").count(text)
    deadline = time.monotonic() + timeout_s
    while log.read_text(errors="replace").count(text) < start + more:
        assert time.monotonic() < deadline, f"no {more} more {text!r} lines in {log} within {timeout_s} s"
        time.sleep(0.1)


def _sync(client, dirs, version: str, pause: str | None = "retract") -> None:
    """A weight sync as WeightSync does it: pause, new weights labelled `version`, continue."""
    if pause:
        client.pause_generation(pause)
    client.update_weights_from_disk(dirs[version], weight_version=version)
    if pause:
        client.continue_generation()


def _in_thread(fn, *args):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, out


_MADE: dict[str, list[Sample]] = {}


def _made(name: str, server, dirs) -> list[Sample]:
    """The samples of one scenario, made once per module (the tests of their routes and the
    replay test share them)."""
    if name not in _MADE:
        _MADE[name] = {"retract": _retracted, "resume": _resumed, "episode": _episode}[name](server, dirs)
    return _MADE[name]


def _retracted(server, dirs) -> list[Sample]:
    """A long greedy request; after >= 40 decoded tokens a sync in `retract` mode (the sync's
    default: SGLang re-queues it and prefills it again under v2)."""
    from rollout.servers.client import SGLangClient
    client = SGLangClient(server.server_urls[0])
    s = Sample(0, 0, {}, list(range(20, 40)), 200)
    thread, out = _in_thread(lambda: client.generate(
        s.tokens, {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True},
        return_routed_experts=True)[0])
    try:
        _wait_in_log(server, "Decode batch", 2)  # a line every 40 decode steps
        _sync(client, dirs, "2")
        thread.join(300)
    finally:
        client.update_weights_from_disk(dirs["1"], weight_version="1")
    got = out["value"]
    s.append_model_tokens(got.output_ids, got.logprobs, got.weight_versions, got.routed_experts)
    return [s]


def _resumed(server, dirs) -> list[Sample]:
    """Partial rollouts through the manager: the step's surplus requests are aborted at v1, a sync,
    and the next step resumes them at v2 (with routing replay they used to restart)."""
    import transformers

    from fixtures_models import tiny_model_dir
    from rollout.prompts.dataset import chat_prompt_ids
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))
    cfg = ManagerConfig(group_size=2, max_new_tokens=48, partial_rollouts=True, ignore_eos=True,
                        oversample_groups=2, return_routed_experts=True)
    mgr = RolloutManager(ServerPool(server.server_urls), cfg, encode_prompt=lambda r: chat_prompt_ids(tok, r),
                         decode=lambda ids: str(tok.decode(ids)), reward_fn=lambda rec, text: float(len(text) % 2))
    try:
        prompts: Iterator[dict] = iter([{"prompt": "short", "answer": "0", "max_new_tokens": 16},
                        {"prompt": "long a", "answer": "0"}, {"prompt": "long b", "answer": "0"}])
        mgr.generate_step(prompts, num_groups=1, current_weight_version="1")
        _sync(SGLangClient(server.server_urls[0]), dirs, "2", pause=None)  # nothing in flight
        step = mgr.generate_step(iter([]), num_groups=2, current_weight_version="2")
    finally:
        SGLangClient(server.server_urls[0]).update_weights_from_disk(dirs["1"], weight_version="1")
        mgr.close()
    assert step.metrics["samples_resumed"] >= 1
    return [s for g in step.groups for s in g]


class _SyncAfterTheFirstTurn(Environment):
    max_turns = 3

    def __init__(self, sync):
        self.sync, self.turns = sync, 0

    def reset(self, prompt):
        return "guess a number"

    def step(self, model_turn):
        from rollout.generation.multiturn import EnvStep
        self.turns += 1
        if self.turns == 1:
            self.sync()
        return EnvStep("higher", 0.5, done=self.turns >= 2)


def _episode(server, dirs) -> list[Sample]:
    """A two-turn episode whose weights change between the turns."""
    import transformers

    from fixtures_models import tiny_model_dir
    from rollout.generation.multiturn import run_episode
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))
    client, pool = SGLangClient(server.server_urls[0]), ServerPool(server.server_urls)
    cfg = ManagerConfig(max_turn_tokens=12, ignore_eos=True, return_routed_experts=True)
    counter = iter(range(100))
    try:
        s = run_episode(Sample(0, 0, {}, [], 60), _SyncAfterTheFirstTurn(lambda: _sync(client, dirs, "2")),
                        pool, cfg, lambda ids: str(tok.decode(ids)), lambda text: tok.encode(text, add_special_tokens=False),
                        lambda smp: f"episode-{next(counter)}")
    finally:
        client.update_weights_from_disk(dirs["1"], weight_version="1")
        pool.close()
    assert [k for k, _, _ in s.metadata["spans"]] == ["model", "env", "model"]
    return [s]


# --- the engine's side: each token's route is the one of the pass that sampled it ---------------
def test_retract_pause_keeps_each_tokens_routes(server, versions):
    s = _made("retract", server, versions)[0]
    n1, n2 = s.weight_versions.count("1"), s.weight_versions.count("2")
    assert n1 and n2 and s.weight_versions == ["1"] * n1 + ["2"] * n2
    paired = _paired(s, versions)
    print(f"retract: {paired['1'][0]} of {paired['1'][1]} rows whose next token v1 sampled carry v1's "
          f"routes, {paired['2'][0]} of {paired['2'][1]} v2's; the prompt's rows {paired['context']}")
    assert all(a == b for a, b in paired.values()), paired


def test_kv_pressure_retraction_then_a_sync_keeps_each_tokens_routes(server, versions):
    """Three long requests in a KV cache that cannot hold them: SGLang retracts one (ScheduleBatch.
    retract_decode) and queues it again; then a retract sync. Without ignore_eos SGLang admits
    them on its estimate of their length (the server fixture; min_new_tokens keeps EOS off) and
    runs out of KV cache as they grow."""
    from rollout.servers.client import SGLangClient
    client = SGLangClient(server.server_urls[0])
    samples = [Sample(0, i, {}, list(range(20 + i, 40 + i)), 150) for i in range(3)]
    params = {"max_new_tokens": 150, "min_new_tokens": 150, "temperature": 0.0}
    threads = [_in_thread(lambda s=s: client.generate(s.tokens, params, return_routed_experts=True)[0])
               for s in samples]
    try:
        _wait_in_log(server, "KV cache pool is full. Retract requests.", 1, timeout_s=300)
        _sync(client, versions, "2")
        for thread, _ in threads:
            thread.join(300)
    finally:
        client.update_weights_from_disk(versions["1"], weight_version="1")
    for s, (_, out) in zip(samples, threads):
        got = out["value"]
        s.append_model_tokens(got.output_ids, got.logprobs, got.weight_versions, got.routed_experts)
        paired = _paired(s, versions, log_probs=False)  # min_new_tokens masks EOS: other log-probs
        assert all(a == b for a, b in paired.values()), (s.index, paired)
    assert any(len(set(s.weight_versions)) == 2 for s in samples)


def test_abort_of_a_retracted_request_drops_its_unrouted_tokens(server, versions):
    """SGLang answers the abort of a request waiting in its queue after a retract without routes
    (in a run: retracted under KV pressure when the rollout thread aborts at a sync): those tokens
    are generated again after the sync, never kept with the next call's routes."""
    from rollout.generation.requests import SampleRequests
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool
    client, pool = SGLangClient(server.server_urls[0]), ServerPool(server.server_urls)
    # room for the pause to arrive late on a loaded host: 100 tokens were once all done before it
    new = 200  # with the prompt, within the tiny model's 256 positions
    cfg = ManagerConfig(max_new_tokens=new, ignore_eos=True, return_routed_experts=True)
    requests = SampleRequests(pool, cfg, decode=str)
    samples = [Sample(0, i, {}, list(range(30 + i, 50 + i)), new) for i in range(2)]
    try:
        futures = [requests.submit(s) for s in samples]
        _wait_in_log(server, "Decode batch", 2)  # 40 to 80 tokens each
        client.pause_generation("retract")
        client.abort(abort_all=True)
        client.continue_generation()
        for f in futures:
            f.result(120)
        assert all(s.finish_reason == "abort" for s in samples), [s.finish_reason for s in samples]
        assert any(s.metadata.get("unrouted_dropped", 0) > 0 for s in samples)  # had tokens, no routes
        _sync(client, versions, "2", pause=None)
        for f in [requests.submit(s) for s in samples]:
            f.result(300)
    finally:
        client.update_weights_from_disk(versions["1"], weight_version="1")
        requests.close()
        pool.close()
    for s in samples:
        assert len(s.response_ids) == new and misalignment(s) is None, misalignment(s)
        assert all(a == b for a, b in _paired(s, versions).values())


def test_partial_resume_across_a_sync_keeps_each_tokens_routes(server, versions, pi_old):
    resumed = [s for s in _made("resume", server, versions) if len(set(s.weight_versions)) == 2]
    assert resumed, "no response was cut at v1 and resumed at v2"
    for s in _made("resume", server, versions):
        assert all(a == b for a, b in _paired(s, versions).values()), s.index
    assert pi_old["resume"] < 1e-5, pi_old


def test_multi_turn_across_a_sync_keeps_each_tokens_routes(server, versions, pi_old):
    s = _made("episode", server, versions)[0]
    assert {v for v in s.weight_versions if v} == {"1", "2"}
    assert all(a == b for a, b in _paired(s, versions).values())
    assert pi_old["episode"] < 1e-5, pi_old


# --- the trainer's side: routing replay on those samples ---------------------------------------
def _replay(rank, world, batch, hf_dir, weights):
    """pi_old per version under replay (v1's weights kept, v2's live), and the recorded routes
    against each version's own choice."""
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import RoutingSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    actor = Actor(hf_dir, ParallelLayout(), micro_batch_size=4, seed=5, max_staleness=1,
                  routing=RoutingSettings(replay=True))
    actor.load_weights(weights["1"])
    actor.keep_version(1)
    actor.load_weights(weights["2"])
    shard = actor.shard(batch)
    shard.old_log_probs, old = actor.compute_old_log_probs(shard, versions=[1, 2], live_version=2)
    checked = actor.measure_version_mismatch(shard, [1, 2], live_version=2, rows=shard.num_rows)
    return dict(old=shard.padded().old_log_probs, metrics={**old, **checked})


@pytest.fixture(scope="module")
def pi_old(server, versions, tmp_path_factory):
    """max |pi_old recomputed under replay - the engine's log-prob| per scenario, over trained
    tokens (fp32, one process), and the pass's metrics under "metrics"."""
    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.driver.samples_to_batch import samples_to_batch
    names = ("retract", "resume", "episode")
    samples = [s for name in names for s in _made(name, server, versions)]
    for s in samples:
        s.reward = 0.0
    batch = samples_to_batch([[s] for s in samples], group_size=1)
    out = tmp_path_factory.mktemp("routes-mcore")
    weights = {v: str(convert_hf_to_megatron(d, out / v)) for v, d in versions.items()}
    got = run_distributed(_replay, 1, (batch, versions["1"], weights), timeout=420)[0]
    padded = batch.padded()
    diff = (got["old"] - padded.rollout_log_probs).abs().masked_fill(~padded.loss_mask, 0.0)
    result, row = {"metrics": got["metrics"]}, 0
    for name in names:
        n = len(_made(name, server, versions))
        result[name] = float(diff[row:row + n].max())
        row += n
    print("max |pi_old - engine| per scenario:", {k: v for k, v in result.items() if k != "metrics"})
    return result


def test_replay_recomputes_pi_old_as_the_engine_per_version(server, versions, pi_old):
    """The step's pi_old under routing replay: each token's from its version's weights, replaying
    the routes its version computed (the retracted response's v1 rows are v1's)."""
    m = pi_old["metrics"]
    assert pi_old["retract"] < 1e-5, pi_old
    assert m["routing_replay_mismatch_sets"] > 0 and m["routing_replay_mismatch"] == 0.0
    assert m["routing_engine_mismatch"] < 0.01, m  # megatron's own choice, each version's pass
    # the recorded routes are what each version's weights choose (no replay): paired
    assert m["routing_version_mismatch_sets"] > 0 and m["routing_version_mismatch"] < 0.01, m
