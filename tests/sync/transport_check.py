"""Checks a row of TRANSPORTS end to end on the every-owner path: a real bf16 SGLang server (tiny
Qwen3-MoE) and 2 trainer ranks under EP2, both of them owners. With deltas where the transport
carries them (sync.delta null) and then without (false): a whole sync, a GSPO step, a second sync.
Every rank's passes are watched (sender_pass.SenderPass.post, the one place a sender's parts
leave): each owner posts through the Sender the transport made, whole in the first sync and, in
the second, as deltas exactly where the row says the transport carries them; the served tensors
then equal the trainer's bit for bit.

    from transport_check import check_every_owner
    print(check_every_owner("tensor", tmp_path))   # raises AssertionError naming what differed
"""
from __future__ import annotations

from pathlib import Path

from distributed import run_distributed
from fixtures_models import tiny_model_dir
from fixtures_servers import launch_tiny_server
from test_weight_sync_sglang import _gspo_step


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _watched(rank, world, name, ckpt, url, scratch):
    import os

    import torch

    from gspo_tables import import_plugins
    import_plugins([m for m in os.environ.get("GSPO_PLUGINS", "").split(",") if m])  # a plug-in's row, here too

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import WeightSync, make_transport, sender_pass
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    used: list[tuple[str, str]] = []  # (the Sender's class, a mode it posted), this rank
    post = sender_pass.SenderPass.post

    def watched_post(self, threads):
        used.extend((_class_path(self.sender), m) for m, parts in self.pending.items() if parts)
        return post(self, threads)
    sender_pass.SenderPass.post = watched_post

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=1e-5, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = transport = None
    made: set[str] = set()  # rank 0: the classes of the Senders the transport made
    if rank == 0:
        pool = ServerPool([url])
        transport = make_transport(name, pool, hf_path=f"{ckpt}/hf", sync_dir=lambda: Path(scratch) / "sync",
                                   master_address="127.0.0.1")
        make_sender = transport.sender

        def sender(version, targets):
            made.add(_class_path(got := make_sender(version, targets)))
            return got
        transport.sender = sender
    out = {"syncs": [], "differ": []}
    for delta in (None, False):
        sync = WeightSync(actor.chunks, hf, transport, pool, bucket_bytes=20_000, delta=delta)
        for step in (0, 1):
            if step:
                _gspo_step(actor, seed=len(out["syncs"]))
            used.clear()
            report = sync.sync(version=f"{'delta' if delta is None else 'whole'}-{step}")
            out["syncs"].append((delta, step, sorted(set(used)), report))
        mine = hf_state_dict(actor.chunks, weight_map_for(hf))
        if rank == 0:
            served = pool.clients[0].served_tensors({n: t.shape for n, t in mine.items()},
                                                    f"{scratch}/served.safetensors")
            out["differ"] += [n for n, t in mine.items() if not torch.equal(served[n], t.to(torch.bfloat16))]
    out["made"] = sorted(made)
    return out


def check_every_owner(name: str, tmp_path: Path) -> str:
    """Runs the check (module docstring) for the row `name`; returns one line saying what it saw."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.sync import TRANSPORTS

    row = TRANSPORTS[name]
    ckpt = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "mcore")
    with launch_tiny_server("qwen3_moe", dtype="bfloat16") as group:
        results = run_distributed(_watched, 2, (name, str(ckpt), group.server_urls[0], str(tmp_path)),
                                  timeout=900)
    made = results[0]["made"]
    assert len(made) == 1, f"the {name} transport made Senders of {made}: expected one class"
    for rank, r in enumerate(results):
        for delta, step, used, report in r["syncs"]:
            mode = "delta" if (step and delta is None and row.deltas) else "full"
            assert used == [(made[0], mode)], (
                f"rank {rank}, sync {step} with delta={delta}: posted {used}, expected [({made[0]!r}, {mode!r})]")
            if rank == 0:
                assert report["senders"] == 2 and report["full_syncs"] == (mode == "full"), report
                assert (report["changed_fraction"] < 1) == (mode == "delta"), report
    assert results[0]["differ"] == [], f"served tensors differ from the trainer's: {results[0]['differ'][:5]}"
    reports = {(d, s): rep for d, s, _, rep in results[0]["syncs"]}
    return (f"{name}: both owners posted through {made[0]}; delta sync {reports[None, 1]['bytes'] / 1e6:.3f} MB "
            f"(changed {reports[None, 1]['changed_fraction']:.4f}), whole sync {reports[False, 1]['bytes'] / 1e6:.3f} MB; "
            "served tensors bit-identical")
