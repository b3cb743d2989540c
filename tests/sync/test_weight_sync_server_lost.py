"""A server killed in the middle of a weight sync, for each transport (rollout/servers/health.py).

Two real SGLang servers: the session's tiny Qwen3 and a victim launched here, which the sender
under test SIGKILLs part-way through the sync (before its second request). For disk, tensor and
distributed in turn:
- the sync completes on the server that is left: it reports the new version, and its log-probs of
  its own generation equal the trainer's (1e-4), so it holds the whole new policy, not a mix
  (tensor and distributed: the request to the victim failed, so the sync ran again on the live
  server, attempts == 2; disk: the victim was lost before the servers load the folder, which the
  live one then did alone, attempts == 1);
- the victim is taken out, restarted by the health monitor, and takes no request from its kill
  until a complete sync has given it the current version; requests sent during the syncs all
  return (resubmitted to the live server when the victim dies under them).
Then the restarted victim is stopped with SIGSTOP just before a (distributed) sync: the sync's pause
waits for the health probe to take it out (within its 10 s timeout + 5 s) and goes on with the
live server; the monitor replaces it. The restarted victim rejoins through a distributed sync of
both servers and generates the trainer's log-probs. Last, stopped with SIGSTOP right after it
admitted a request of a rollout step (between syncs), the step still returns every response in
full (its requests resubmitted to the live server) and the probe takes it out within the health
timeout + 5 s.

Before: a failed tensor or distributed sync left the servers' weight-update session open, so every
later begin_weight_update was refused; a server lost during the distributed broadcast ended the run.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from distributed import run_distributed
from fixtures_models import tiny_model_dir
from gspo_megatron.sync import Sender, Transport
from test_weight_sync_sglang import PROMPT, _gspo_step, _trainer_log_probs

pytestmark = pytest.mark.slow
TRANSPORTS = ["disk", "tensor", "distributed"]


# Rank 0's victims by key: the sender travels to the ranks pickled, a server's process does not.
_KILLS: dict[int, dict] = {}


@dataclass
class _KillingSender(Sender):
    """The sender under test, SIGKILLing the victim before its request `at` (once)."""

    inner: Sender
    key: int

    def open(self, state, targets):
        self.requests = 0
        return self.inner.open(state, targets)

    def pack(self, state, mode, parts):
        kill = _KILLS[self.key]
        if self.requests == kill["at"] and kill["generates"] is None:
            kill["victim"].kill()  # SIGKILL to its process group, then wait for the leader
            kill["generates"] = _generates(kill["victim"])
        self.requests += 1
        return self.inner.pack(state, mode, parts)

    def post(self, state, url, packed):
        return self.inner.post(state, url, packed)

    def close(self, state):
        self.inner.close(state)


class _KillAt(Transport):
    """The transport under test, with _KillingSender's kill; generates_at_kill: the victim's
    /generate count at the kill (the sync's next attempt sends undisturbed)."""

    def __init__(self, inner: Transport, victim, at: int = 1) -> None:
        super().__init__(inner.pool)
        self.inner, self.key = inner, len(_KILLS)
        self.name = inner.name  # type: ignore[misc]  # this transport stands in for `inner` under its name
        _KILLS[self.key] = {"victim": victim, "at": at, "generates": None}

    @property
    def generates_at_kill(self) -> int | None:
        return _KILLS[self.key]["generates"]

    def begin(self, version):
        self.inner.begin(version)

    def sender(self, version, targets):
        return _KillingSender(self.inner.sender(version, targets), self.key)

    def finish(self, version):
        self.inner.finish(version)

    def abort(self, version):
        self.inner.abort(version)


def _generates(server) -> int:
    return server.log_path.read_text().count("POST /generate")


def _wait_for(cond, timeout: float, what: str, lines: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s; said:\n" + "\n".join(lines)
        time.sleep(0.2)


# The victim still decodes when the stop lands: with 60 tokens a loaded host's poll of the log was
# once late enough that the victim had answered all of its requests (none left to move)
NEW_TOKENS = 240


def _stop_mid_request(pool, victim, lines: list[str], stamps: list[float]) -> dict:
    """SIGSTOP the (live) victim's process group right after it admitted a request of a rollout
    step (a hung server between syncs): the step still returns every response in full, its
    requests moved to the other server, and the probe takes the victim out within the health
    timeout + 5 s. (Its restart bound is spent: it stays out, and the caller kills it.)"""
    from rollout.generation.manager import ManagerConfig, RolloutManager
    mgr = RolloutManager(pool, ManagerConfig(group_size=4, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                             request_timeout_s=300),
                         encode_prompt=lambda rec: [1, 2, 3, int(rec["answer"])],
                         decode=lambda ids: "", reward_fn=lambda r, t: 0.0)
    prefills = lambda: victim.log_path.read_text().count("Prefill batch")  # noqa: E731
    stopped: list[float] = []

    def stop_victim_when_it_generates():
        n = prefills()
        _wait_for(lambda: prefills() > n, 60, "the victim gets a request", lines)
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        stopped.append(time.monotonic())
    stopper = threading.Thread(target=stop_victim_when_it_generates)
    stopper.start()
    first = len(lines)  # what is said from here on
    result = mgr.generate_step(iter([{"prompt": "p", "answer": str(i + 5)} for i in range(4)]), num_groups=4)
    stopper.join()
    probed = lambda: [i for i in range(first, len(lines))  # noqa: E731
                      if f"{victim.url} taken out of service: health probe: no answer" in lines[i]]
    _wait_for(lambda: probed(), 30, "the stalled server taken out", lines)
    out_at = stamps[probed()[0]]  # when the pool said it
    victim.kill()  # SIGKILL reaches a stopped process
    mgr.close()
    return {"lengths": sorted({len(s.response_ids) for g in result.groups for s in g}),
            "after_stop_s": out_at - stopped[0], "metrics": pool.pop_health_metrics()}


def _body(rank, world, ckpt, live_url, disk_root):
    import torch

    from fixtures_servers import launch_tiny_server
    from gspo_megatron.actor import actor as actor_mod
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config, load_model
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import DiskTransport, DistributedTransport, TensorTransport, WeightSync
    from rollout.servers.client import SGLangClient
    from rollout.servers.health import REJOINING, HealthMonitor, ServerHealthSettings
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = actor_mod.Actor(hf, ParallelLayout(), micro_batch_size=2,
                            optimizer=OptimizerSettings(lr=2e-3, clip_grad=0.0),
                            loss=LossSettings(name="gspo"))
    load_model(actor.chunks, ckpt)
    sampling = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}

    def trainer_error(gen) -> float:
        mine = _trainer_log_probs(actor, PROMPT + gen.output_ids, len(PROMPT))
        assert mine is not None
        return (torch.tensor(gen.logprobs) - mine).abs().max().item()

    lines: list[str] = []
    stamps: list[float] = []  # when each line was said

    def say(line: str) -> None:
        stamps.append(time.monotonic())
        lines.append(line)
    with launch_tiny_server("qwen3") as group:
        victim, victim_url = group.servers[0], group.server_urls[0]
        pool = ServerPool([live_url, victim_url], retries=1, backoff_s=0.1, log=say)
        monitor = HealthMonitor(pool, ServerHealthSettings(server_health_interval_s=0.5,
                                                           server_health_timeout_s=10.0,
                                                           server_max_restarts=4),
                                launched=group.launched(), log=say).start()
        transports = {"disk": DiskTransport(pool, disk_root, f"{ckpt}/hf"), "tensor": TensorTransport(pool),
                      "distributed": DistributedTransport(pool)}
        results, killed_generates = {}, None
        try:
            for step, name in enumerate(TRANSPORTS, start=1):
                if step > 1:  # the victim killed in the previous sync is back, not serving yet
                    _wait_for(lambda: pool.status(victim_url) == REJOINING, 180, "victim restarted", lines)
                _gspo_step(actor, seed=step)
                # requests keep coming during the sync: every one must return
                stop, failures, served = threading.Event(), [], []

                def keep_generating():
                    while not stop.is_set():
                        try:
                            served.append(pool.generate([3, 17, 99], {**sampling, "max_new_tokens": 8}))
                        except Exception as e:  # noqa: BLE001 - asserted on below
                            failures.append(f"{type(e).__name__}: {e}")
                            return
                load = threading.Thread(target=keep_generating)
                load.start()
                killer = _KillAt(transports[name], victim)
                try:
                    report = WeightSync(actor.chunks, hf, killer, pool,
                                        bucket_bytes=100_000).sync(version=f"v{step}-{name}")
                finally:
                    stop.set()
                    load.join(timeout=120)
                gen = pool.generate(PROMPT, sampling)  # only the live server serves now
                killed_generates = killed_generates if killed_generates is not None else killer.generates_at_kill
                results[name] = {"victim": pool.status(victim_url), "versions": pool.weight_versions(),
                                 "error": trainer_error(gen), "labels": sorted(set(gen.weight_versions)),
                                 "attempts": report["attempts"], "failures": failures,
                                 "served": len(served), "victim_generates": _generates(victim) - killed_generates}
            # stalled just before a sync (SIGSTOP): the sync's pause waits for the probe to take it
            # out, then goes on with the live server; the monitor replaces it (SIGKILL + restart)
            _wait_for(lambda: pool.status(victim_url) == REJOINING, 180, "victim restarted", lines)
            _gspo_step(actor, seed=4)
            os.killpg(victim.proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            report = WeightSync(actor.chunks, hf, transports["distributed"], pool,
                                bucket_bytes=100_000).sync(version="v4-stalled")
            gen = pool.generate(PROMPT, sampling)
            results["stalled"] = {"victim": pool.status(victim_url), "versions": pool.weight_versions(),
                                  "error": trainer_error(gen), "labels": sorted(set(gen.weight_versions)),
                                  "attempts": report["attempts"], "sync_s": time.monotonic() - stopped}
            # back: the next sync (distributed, a new group of both servers) makes it live
            _wait_for(lambda: pool.status(victim_url) == REJOINING, 180, "victim restarted", lines)
            _gspo_step(actor, seed=5)
            report = WeightSync(actor.chunks, hf, transports["distributed"], pool,
                                bucket_bytes=100_000).sync(version="v5-back")
            before = _generates(victim) - killed_generates
            gen = SGLangClient(victim_url).generate(PROMPT, sampling)[0]
            served = _generates(victim)
            for _ in range(4):  # round robin: it serves the pool's requests again
                pool.generate([1, 2, 3], {**sampling, "max_new_tokens": 2})
            results["back"] = {"victim": pool.status(victim_url), "versions": pool.weight_versions(),
                               "error": trainer_error(gen), "labels": sorted(set(gen.weight_versions)),
                               "attempts": report["attempts"], "victim_generates": before,
                               "round_robin": _generates(victim) - served,
                               "metrics": pool.pop_health_metrics()}
            results["mid_request"] = _stop_mid_request(pool, victim, lines, stamps)
        finally:
            monitor.close()
            transports["distributed"].close()
            pool.close()
    return results, lines


def test_a_server_killed_during_each_transports_sync_never_serves_mixed_or_old_weights(qwen3_server, tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from rollout.servers.health import LIVE, OUT
    from rollout.servers.pool import ServerPool

    hf_dir = tiny_model_dir("qwen3", 0)  # what the session server serves
    live = qwen3_server.server_urls[0]
    ckpt = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    try:
        [(results, lines)] = run_distributed(_body, 1, (str(ckpt), live, str(tmp_path / "disk")),
                                             timeout=900)
    finally:  # the session server must serve the seed-0 weights again
        pool = ServerPool([live])
        pool.continue_generation()
        pool.update_weights_from_disk(str(hf_dir), weight_version="default")
    log = "\n".join(lines)
    for step, name in enumerate(TRANSPORTS, start=1):
        r = results[name]
        version = f"v{step}-{name}"
        assert r["victim"] == OUT and r["versions"] == {live: version}, (name, r, log)
        assert r["labels"] == [version] and r["error"] < 1e-4, (name, r)
        assert r["attempts"] == (1 if name == "disk" else 2), (name, r, log)
        assert r["failures"] == [] and r["served"] >= 1, (name, r)
        assert r["victim_generates"] == 0, (name, r)  # nothing served from its kill on
        print(f"{name}: victim out, live server at {version}, |sglang - trainer| {r['error']:.2g}, "
              f"{r['served']} requests served during the sync, {r['attempts']:.0f} attempt(s)")
    stalled = results["stalled"]
    assert stalled["victim"] == OUT and stalled["versions"] == {live: "v4-stalled"}, (stalled, log)
    assert stalled["labels"] == ["v4-stalled"] and stalled["error"] < 1e-4, stalled
    assert stalled["sync_s"] <= 10.0 + 5, stalled  # taken out within the health timeout + 5 s
    assert "taken out of service: health probe: no answer to /model_info within" in log, log
    print(f"stalled before a sync: taken out and the sync done {stalled['sync_s']:.1f} s after SIGSTOP")
    back = results["back"]
    assert back["victim"] == LIVE and set(back["versions"].values()) == {"v5-back"}, (back, log)
    assert back["labels"] == ["v5-back"] and back["error"] < 1e-4 and back["attempts"] == 1, back
    assert back["victim_generates"] == 0, back  # it rejoined without a request before the sync
    assert back["metrics"]["rollout/server_restarts"] == 4 and back["metrics"]["rollout/servers_live"] == 2
    assert back["round_robin"] >= 2, back
    assert "back in service at weight version v5-back" in log, log
    mid = results["mid_request"]
    assert mid["lengths"] == [NEW_TOKENS], mid  # every response in full: the stopped server's moved on
    assert mid["metrics"]["rollout/requests_resubmitted"] >= 1 and mid["metrics"]["rollout/servers_live"] == 1, mid
    assert mid["after_stop_s"] <= 10.0 + 5, mid  # out within the health timeout + 5 s
    print(f"stalled mid-request: taken out {mid['after_stop_s']:.1f} s after SIGSTOP, "
          f"{mid['metrics']['rollout/requests_resubmitted']:.0f} request(s) resubmitted")
