"""Every owner sends its own weights, and after the first sync only what changed: a real bf16
SGLang server (tiny Qwen3-MoE) takes a full sync then 20 delta syncs, each after a GSPO step, from
4 trainer ranks; after the last, the served tensors (read back through the project's loader,
rollout/in_server/weight_loader.py) equal the trainer's in the served dtype bit for bit, under PP2 x EP2 and
TP2 x EP2. Rank 0 sends only what it owns; the server verifies checksums; a weight changed on the
server behind the trainer's back is caught by the next delta's checksum, and that server gets a
full sync in the same call.

One server for the module; one spawn of 4 ranks per layout, which runs both transports in turn
(the spawn, the actor's build and the checkpoint conversion are shared).
"""
from __future__ import annotations

import contextlib
import glob

import pytest
import torch

from distributed import run_distributed
from fixtures_models import tiny_model_dir
from fixtures_servers import launch_tiny_server
from test_weight_sync_sglang import _gspo_step

pytestmark = pytest.mark.slow
DELTAS = 20
TRANSPORTS = ("tensor", "distributed")


def _transport(name, pool):
    from gspo_megatron.sync import DistributedTransport, TensorTransport
    return TensorTransport(pool) if name == "tensor" else DistributedTransport(pool)


def _body(rank, world, ckpt, url, layout_kw, scratch, hf_path, corrupt):
    """Each transport in turn on the same 4 ranks and server: a full sync, then DELTAS delta syncs
    each after a GSPO step; a new WeightSync per transport starts with a full sync whatever the
    server holds, so the second transport's run is the first's on weights that moved on."""
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import WeightSync
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    # lr 1e-5: most bf16 weights move by less than their resolution per step (a sparse delta)
    actor = Actor(hf, ParallelLayout(**layout_kw), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    out = {}
    for i, transport in enumerate(TRANSPORTS):
        sync = WeightSync(actor.chunks, hf, _transport(transport, pool) if rank == 0 else None, pool,
                          bucket_bytes=64_000)
        reports = [sync.sync(version=f"{transport}-full")]
        for step in range(1, DELTAS + 1):
            _gspo_step(actor, seed=i * DELTAS + step)
            if step == 2 and corrupt and rank == 0:
                # The server's embedding changes behind the trainer's back (its version label
                # stays): the next delta's checksum must catch it and send that server everything.
                from safetensors.torch import load_file
                embed = load_file(glob.glob(f"{hf_path}/*.safetensors")[0])["model.embed_tokens.weight"]
                c = pool.clients[0]
                c.begin_weight_update()
                c.update_weights_from_tensor([("model.embed_tokens.weight", embed + 1.0)], flush_cache=False)
                c.end_weight_update()
            reports.append(sync.sync(version=f"{transport}-delta{step}"))
        mine = hf_state_dict(actor.chunks, weight_map_for(hf))
        if rank == 0:
            served = pool.clients[0].served_tensors({n: t.shape for n, t in mine.items()},
                                                    f"{scratch}/served-{transport}.safetensors")
            differ = [n for n, t in mine.items() if not torch.equal(served[n], t.to(torch.bfloat16))]
            out[transport] = dict(reports=reports, differ=differ, n=len(mine),
                                  version=pool.clients[0].weight_version())
    return out if rank == 0 else None


@contextlib.contextmanager
def _checkpoint_then_restore(server, tmp_path):
    """The seed-0 tiny Qwen3-MoE as a megatron checkpoint and the module server's URL; after the
    block the server serves the seed-0 weights again, generating."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from rollout.servers.pool import ServerPool
    hf_dir = tiny_model_dir("qwen3_moe", 0)
    url = server.server_urls[0]
    try:
        yield str(convert_hf_to_megatron(hf_dir, tmp_path / "mcore")), url
    finally:
        pool = ServerPool([url])
        pool.continue_generation()
        pool.update_weights_from_disk(str(hf_dir), weight_version="default")


@pytest.fixture(scope="module")
def bf16_moe_server():
    with launch_tiny_server("qwen3_moe", dtype="bfloat16") as group:
        yield group


@pytest.mark.parametrize("layout", [dict(pipeline=2, expert=2), dict(tensor=2, expert=2)],
                         ids=["pp2-ep2", "tp2-ep2"])
def test_delta_syncs_bit_exact(layout, bf16_moe_server, tmp_path):
    corrupt = layout.get("pipeline") == 2
    with _checkpoint_then_restore(bf16_moe_server, tmp_path) as (ckpt, url):
        results = run_distributed(_body, 4, (ckpt, url, layout, str(tmp_path),
                                             str(tiny_model_dir("qwen3_moe", 0)), corrupt),
                                  timeout=1500)
    assert sorted(results[0]) == sorted(TRANSPORTS)
    for transport, r in results[0].items():
        full, deltas = r["reports"][0], r["reports"][1:]
        changed = [d["changed_fraction"] for d in deltas]
        print(f"{layout} {transport}: full sync {full['bytes'] / 1e6:.2f} MB from {full['senders']:.0f} senders "
              f"(rank 0 {full['rank0_bytes'] / 1e6:.2f} MB); deltas {min(d['bytes'] for d in deltas) / 1e6:.3f}-"
              f"{max(d['bytes'] for d in deltas) / 1e6:.3f} MB, changed {min(changed):.3f}-{max(changed):.3f}")
        assert r["differ"] == [], f"{transport}: served tensors differ from the trainer's: {r['differ'][:5]}"
        assert r["version"] == f"{transport}-delta{DELTAS}"
        repaired = [i for i, d in enumerate(deltas, start=1) if d["full_syncs"]]
        assert full["full_syncs"] == 1 and repaired == ([2] if corrupt else []), transport
        if corrupt:
            assert deltas[1]["checksum_mismatches"] >= 1 and deltas[1]["attempts"] == 2, transport
        assert sum(d["checksum_mismatches"] for d in r["reports"]) == \
            (deltas[1]["checksum_mismatches"] if corrupt else 0), transport
        assert full["senders"] >= 2 and full["rank0_bytes"] < full["bytes"] and full["changed_fraction"] == 1.0
        assert all(0 < d["bytes"] < full["bytes"] / 2 for i, d in enumerate(deltas, start=1) if i not in repaired)
        assert 0 < min(changed) and max(changed) < 0.5, (transport, changed)


def _sender_killed(rank, world, ckpt, url, scratch, transport):
    """EP2 on 2 ranks: a full sync, a delta sync, then rank 1 is SIGKILLed after its first
    request of the next delta sync (rank 0 then waits on it in a collective: a real job's
    launcher would end it). Distributed: the server is left waiting in a receive from the dead
    sender, or in its next request."""
    import os
    import signal

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import WeightSync
    from gspo_megatron.sync.distributed import GroupSender
    from gspo_megatron.sync.tensor import TensorSender
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    sync = WeightSync(actor.chunks, hf, _transport(transport, pool) if rank == 0 else None, pool,
                      bucket_bytes=20_000)
    sync.sync(version="full")
    _gspo_step(actor, seed=1)
    sync.sync(version="delta1")
    _gspo_step(actor, seed=2)
    if rank == 1:
        sender = TensorSender if transport == "tensor" else GroupSender
        post = sender.post

        def post_then_die(*args):
            out = post(*args)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-sync: its other buckets never leave
            return out
        sender.post = post_then_die
    sync.sync(version="delta2")
    return None


def _fresh_job(rank, world, ckpt, url, scratch, transport):
    """A new trainer job after the crash: its first sync is full and un-pauses the server."""
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import WeightSync
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    _gspo_step(actor, seed=7)
    pool = ServerPool([url]) if rank == 0 else None
    report = WeightSync(actor.chunks, hf, _transport(transport, pool) if rank == 0 else None, pool,
                        bucket_bytes=20_000).sync(version="restarted")
    mine = hf_state_dict(actor.chunks, weight_map_for(hf))
    if rank != 0:
        return None
    served = pool.clients[0].served_tensors({n: t.shape for n, t in mine.items()},
                                            f"{scratch}/served.safetensors")
    gen = pool.generate([5, 7, 9], {"max_new_tokens": 2})
    return dict(report=report, differ=[n for n, t in mine.items()
                                       if not torch.equal(served[n], t.to(torch.bfloat16))],
                labels=sorted(set(gen.weight_versions)))


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_a_sender_killed_mid_delta_never_leaves_a_mix_served(transport, bf16_moe_server, tmp_path):
    from distributed import RankDied
    from rollout.servers.client import SGLangClient
    with _checkpoint_then_restore(bf16_moe_server, tmp_path) as (ckpt, url):
        with pytest.raises(RankDied) as died:
            # rank 0 may wait on the dead rank for good (a collective): a few seconds show that
            # it did not die as well
            run_distributed(_sender_killed, 2, (ckpt, url, str(tmp_path), transport), timeout=600,
                            after_death=3)
        assert died.value.exit_codes == {1: -9}
        # the server still says delta1 and serves nothing (paused, perhaps holding a mix)
        client = SGLangClient(url, timeout_s=5, retries=0)
        version = client.weight_version()
        with pytest.raises(Exception) as no_answer:
            client.generate([5, 7, 9], {"max_new_tokens": 2})
        again = run_distributed(_fresh_job, 2, (ckpt, url, str(tmp_path), transport), timeout=600)[0]
    print(f"sender killed mid-delta: the server kept version {version} and answered no request "
          f"({type(no_answer.value).__name__}); the next job's full sync: "
          f"{again['report']['bytes'] / 1e6:.2f} MB, bit-exact")
    assert version == "delta1"
    assert again["differ"] == [] and again["labels"] == ["restarted"]
    assert again["report"]["full_syncs"] == 1


def _server_killed(rank, world, ckpt, live_url, scratch):
    """EP2 on 2 ranks, two servers, the distributed transport: the victim is SIGKILLed after a
    delta sync, the health monitor restarts it; the sync while it is out goes to the live server
    alone (a delta), the first sync after it is back gives it everything (each sender over a new
    group with it) and the live server a delta, the next gives both deltas. The tensor transport
    takes the same decisions (WeightSync._targets) with nothing of its own to remake."""
    from fixtures_servers import launch_tiny_server
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import WeightSync
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.health import LIVE, REJOINING, HealthMonitor, ServerHealthSettings
    from rollout.servers.pool import ServerPool
    from test_weight_sync_server_lost import _wait_for

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    lines: list[str] = []
    group = launch_tiny_server("qwen3_moe", dtype="bfloat16") if rank == 0 else None
    pool = monitor = None
    if rank == 0:
        group.__enter__()
        victim, victim_url = group.servers[0], group.server_urls[0]
        pool = ServerPool([live_url, victim_url], retries=1, backoff_s=0.1, log=lines.append)
        monitor = HealthMonitor(pool, ServerHealthSettings(server_health_interval_s=0.5,
                                                           server_health_timeout_s=10.0,
                                                           server_max_restarts=2),
                                launched=group.launched(), log=lines.append).start()
    try:
        sync = WeightSync(actor.chunks, hf, _transport("distributed", pool) if rank == 0 else None,
                          pool, bucket_bytes=20_000)
        reports = {"v0": sync.sync(version="v0")}
        _gspo_step(actor, seed=1)
        reports["d1"] = sync.sync(version="d1")
        if rank == 0:
            victim.kill()
            _wait_for(lambda: pool.status(victim_url) != LIVE, 60, "victim taken out", lines)
        _gspo_step(actor, seed=2)
        reports["d2"] = sync.sync(version="d2")  # the live server alone
        if rank == 0:
            _wait_for(lambda: pool.status(victim_url) == REJOINING, 300, "victim restarted", lines)
        _gspo_step(actor, seed=3)
        reports["d3"] = sync.sync(version="d3")  # back: everything to it, a delta to the other
        _gspo_step(actor, seed=4)
        reports["d4"] = sync.sync(version="d4")
        mine = hf_state_dict(actor.chunks, weight_map_for(hf))
        if rank != 0:
            return None
        differ = {}
        for c in pool.clients:
            served = c.served_tensors({n: t.shape for n, t in mine.items()},
                                      f"{scratch}/served-{c.url.rsplit(':', 1)[1]}.safetensors")
            differ[c.url] = [n for n, t in mine.items() if not torch.equal(served[n], t.to(torch.bfloat16))]
        return dict(reports=reports, differ=differ, versions=pool.weight_versions(),
                    victim=pool.status(victim_url), lines=lines)
    finally:
        if rank == 0:
            monitor.close()
            pool.close()
            group.__exit__(None, None, None)


def test_a_server_killed_comes_back_with_a_full_sync_then_deltas(bf16_moe_server, tmp_path):
    from rollout.servers.health import LIVE
    with _checkpoint_then_restore(bf16_moe_server, tmp_path) as (ckpt, url):
        r = run_distributed(_server_killed, 2, (ckpt, url, str(tmp_path)), timeout=900)[0]
    rep, log = r["reports"], "\n".join(r["lines"])
    print("full syncs per sync:", {v: x["full_syncs"] for v, x in rep.items()},
          "bytes:", {v: round(x["bytes"] / 1e6, 3) for v, x in rep.items()})
    assert [rep[v]["full_syncs"] for v in ("v0", "d1", "d2", "d3", "d4")] == [2, 0, 0, 1, 0], (rep, log)
    assert r["victim"] == LIVE and set(r["versions"].values()) == {"d4"}, (r["versions"], log)
    assert all(d == [] for d in r["differ"].values()), r["differ"]


def _disk_then_rank0(rank, world, ckpt, url, scratch):
    """PP2 x EP2: two syncs through the disk transport (every owner), then two through the tensor
    transport with rank 0 the only sender (sync.senders=rank0), each pair around a GSPO step; the
    served tensors read back after each pair."""
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import DiskTransport, TensorTransport, WeightSync
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(pipeline=2, expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    out = {"reports": [], "differ": [], "folders": None}

    def differ():
        mine = hf_state_dict(actor.chunks, weight_map_for(hf))
        if rank == 0:
            served = pool.clients[0].served_tensors({n: t.shape for n, t in mine.items()},
                                                    f"{scratch}/served.safetensors")
            out["differ"] += [n for n, t in mine.items() if not torch.equal(served[n], t.to(torch.bfloat16))]
    for name, transport, senders in (("disk", DiskTransport, "owners"), ("rank0", TensorTransport, "rank0")):
        made = None if rank else (transport(pool, f"{scratch}/disk", f"{ckpt}/hf") if name == "disk" else
                                  transport(pool))
        sync = WeightSync(actor.chunks, hf, made, pool, bucket_bytes=20_000, senders=senders)
        out["reports"].append(sync.sync(version=f"{name}0"))
        _gspo_step(actor, seed=len(out["reports"]))
        out["reports"].append(sync.sync(version=f"{name}1"))
        differ()
        if rank == 0 and name == "disk":
            import os
            out["folders"] = sorted(os.listdir(f"{scratch}/disk"))
    if rank != 0:
        return None
    return dict(out, version=pool.clients[0].weight_version())


def test_disk_every_owner_writes_its_shards_and_rank0_sends_alone(bf16_moe_server, tmp_path):
    """PP2 x EP2 through the disk transport: the 4 owners write their own shards of the version's
    folder, rank 0 indexes them and has the server load it; whole tensors every time. Then rank 0
    as the only sender (the same pass): whole, then a delta. The report means the same on both:
    changed_fraction 1 for a whole sync, the measured fraction for a delta."""
    with _checkpoint_then_restore(bf16_moe_server, tmp_path) as (ckpt, url):
        r = run_distributed(_disk_then_rank0, 4, (ckpt, url, str(tmp_path)), timeout=600)[0]
    full, second, alone, alone_delta = r["reports"]
    print(f"disk, every owner: {full['bytes'] / 1e6:.2f} MB from {full['senders']:.0f} senders "
          f"(rank 0 {full['rank0_bytes'] / 1e6:.2f} MB); rank 0 alone: {alone['bytes'] / 1e6:.2f} MB, "
          f"then a delta of {alone_delta['bytes'] / 1e6:.3f} MB (changed {alone_delta['changed_fraction']:.3f})")
    assert r["differ"] == [] and r["version"] == "rank01" and r["folders"] == ["weights-disk1"]
    assert full["senders"] == 4 and full["rank0_bytes"] < full["bytes"] / 2
    assert second["full_syncs"] == 1 and second["bytes"] == full["bytes"]
    assert full["changed_fraction"] == second["changed_fraction"] == 1.0  # whole: every element sent
    assert alone["senders"] == 1 and alone["rank0_bytes"] == alone["bytes"] == full["bytes"]
    assert alone["changed_fraction"] == 1.0 and alone["full_syncs"] == 1
    assert alone_delta["senders"] == 1 and alone_delta["full_syncs"] == 0
    assert 0 < alone_delta["changed_fraction"] < 0.5 and 0 < alone_delta["bytes"] < full["bytes"] / 2
