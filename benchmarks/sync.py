"""Weight sync: everything through trainer rank 0, every tensor every time, against every owner
sending its own tensors, whole and as deltas after real GSPO steps, on 4 trainer ranks (gloo) and
a real bf16 CPU SGLang server; then a projection to Qwen3-30B-A3B and Qwen3-235B-A22B.

    python benchmarks/sync.py                                 # PP2 x EP2, Qwen3-MoE hidden 512, 4 layers
    python benchmarks/sync.py --layout tp2ep2 --repeats 5     # TP2 x EP2
    python benchmarks/sync.py --lrs 1e-3 1e-6 --steps 5       # the main job's and the paper's LR
    python benchmarks/sync.py --transport distributed         # broadcast over weights-update groups

Rows: "rank 0, full" (sync.senders=rank0, delta off: the owners hand their tensors to rank 0,
which sends them all), "owners, full" (senders=owners, delta off), and per learning rate the
delta syncs of every owner, each after one GSPO step (random prompts, fixed advantages) at that
LR, after a first full sync: "delta, all checked" the first 3 (the server verifies every tensor
sent), "delta" the others (a sample verified). Bytes are what the senders put on the wire, in the
served dtype (bf16); "rank 0 MB" what trainer rank 0 sent itself; "changed" the fraction of
elements that differ from the previous sync (1 for a full one). CPU seconds are noisy and the
server shares the 2 cores with 4 trainer ranks: compare rows of one run. The last line:
    sync: rank-0 GiB <old> -> <new>, total GiB <old> -> <new>, seconds <old> -> <new>, bit-identical <yes|no>
(old: rank 0 full; new: owners, delta at the smallest LR; bit-identical: the served tensors read
back after the last delta sync equal the trainer's in bf16).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYOUTS = {"pp2ep2": dict(pipeline=2, expert=2), "tp2ep2": dict(tensor=2, expert=2)}
# Projection: bf16 weights, every owner sending over its own NIC, the servers' NICs the same.
GBPS_PER_GPU = 25.0  # GB/s: one 400 Gb/s NIC per H100 at about half of line rate end to end
PROJECTED = [  # (model, parameters, trainer layout, senders = PP x EP, server GPUs, peers' figures)
    ("Qwen3-30B-A3B", 30.5e9, "PP1 x EP8 (8 GPUs)", 8, 8,
     "verl full 32.2 s / delta 7.1 s; miles P2P 2.16 s; NeMo-RL 0.74-1.0 s"),
    ("Qwen3-235B-A22B", 235e9, "PP4 x EP8 (32 GPUs)", 32, 16,
     "verl full 246-266 s / delta_sharded 11.4-14.9 s; miles P2P 3.16 s (NCCL bcast 10.75 s)"),
]


def _step(actor, seed: int) -> None:
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 500, (4, 32), generator=g)
    batch = TrainBatch(tokens=tokens, lengths=torch.full((4,), 32),
                       loss_mask=torch.arange(32)[None].expand(4, 32) >= 8,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_log_probs, _ = actor.compute_old_log_probs(batch)
    actor.train_step(batch)


def _body(rank, world, ckpt, url, layout, lr, repeats, steps, bucket_bytes, fulls, scratch, transport_name):
    import torch

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import DistributedTransport, TensorTransport, Transport, WeightSync
    from gspo_megatron.sync.sender_pass import CHECK_FIRST_DELTAS
    from gspo_megatron.sync.stream import hf_state_dict
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(**layout), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=lr, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    transport: Transport | None = None
    if pool is not None:  # rank 0
        transport = TensorTransport(pool) if transport_name == "tensor" else DistributedTransport(pool)

    def make(**kw):
        return WeightSync(actor.chunks, hf, transport, pool, bucket_bytes=bucket_bytes, **kw)
    out: dict[str, Any] = {}
    if fulls:
        for name, kw in (("rank 0, full", dict(senders="rank0", delta=False)),
                         ("owners, full", dict(senders="owners", delta=False))):
            sync = make(**kw)
            out[name] = [sync.sync(version=f"{name}-{lr}-{i}") for i in range(repeats)]
    sync = make(senders="owners", delta=True)
    sync.sync(version=f"first-{lr}")
    reports = []
    for i in range(steps):
        _step(actor, seed=i + 1)
        reports.append(sync.sync(version=f"delta-{lr}-{i}"))
    # the first deltas verify every tensor they send on the server, the later ones a sample
    out[f"delta, all checked, lr {lr:g}"] = reports[:CHECK_FIRST_DELTAS]
    if reports[CHECK_FIRST_DELTAS:]:
        out[f"delta, lr {lr:g}"] = reports[CHECK_FIRST_DELTAS:]
    mine = hf_state_dict(actor.chunks, weight_map_for(hf))
    if pool is None or mine is None:  # not rank 0
        return None
    served = pool.clients[0].served_tensors({n: t.shape for n, t in mine.items()},
                                            f"{scratch}/served-{lr}.safetensors")
    dtype = next(iter(served.values())).dtype  # what the server serves
    out["bit_identical"] = all(torch.equal(served[n], t.to(dtype)) for n, t in mine.items())
    out["dtype"] = str(dtype).removeprefix("torch.")
    out["params"] = sum(t.numel() for t in mine.values())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2ep2")
    p.add_argument("--bucket-mb", type=float, default=16)
    p.add_argument("--repeats", type=int, default=3, help="full syncs per full row")
    p.add_argument("--steps", type=int, default=6, help="GSPO steps (and delta syncs) per LR")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-6],
                   help="learning rates of the delta rows (default: the main job's, the paper's)")
    p.add_argument("--transport", choices=["tensor", "distributed"], default="tensor",
                   help="tensor: shared memory (servers on the trainer's machine); distributed: "
                        "broadcast over a weights-update group per sender and server")
    p.add_argument("--model", help="an HF Qwen3-MoE folder to sync instead of making one (--hidden ... ignored)")
    p.add_argument("--url", help="with --model: an SGLang server already serving it (its weights are "
                                 "replaced; its dtype is what the sync compares in)")
    args = p.parse_args(argv)
    if args.url and not args.model:
        p.error("--url needs --model (the model the server serves)")

    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from rollout.servers.pool import ServerPool
    from rollout.servers.launch import ServerConfig, ServerGroup
    from model_specs import load_hf_config
    from model_specs.hf.config import normalize_hf_config
    from tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="gspo-bench-sync-"))
    h = args.hidden
    model_dir = Path(args.model) if args.model else make_tiny_model(
        "qwen3_moe", work / "hf", seed=0, hidden_size=h, intermediate_size=2 * h,
        moe_intermediate_size=h // 2, num_hidden_layers=args.layers, num_experts=args.experts,
        num_attention_heads=8, num_key_value_heads=4, head_dim=h // 8)
    hf = normalize_hf_config(load_hf_config(model_dir))
    h, args.layers, args.experts = hf["hidden_size"], hf["num_hidden_layers"], hf["num_experts"]
    ckpt = convert_hf_to_megatron(model_dir, work / "mcore")
    layout = LAYOUTS[args.layout]
    rows, identical, params = {}, [], 0
    with (ServerGroup.attach([args.url]) if args.url else
          ServerGroup.launch(ServerConfig(model_path=str(model_dir), device="cpu", dtype="bfloat16",
                                          startup_timeout_s=600))) as group:
        url = group.server_urls[0]
        for i, lr in enumerate(args.lrs):
            got = run_distributed(_body, 4, (str(ckpt), url, layout, lr, args.repeats, args.steps,
                                             int(args.bucket_mb * (1 << 20)), i == 0, str(work),
                                             args.transport),
                                  timeout=3600)[0]
            identical.append(got.pop("bit_identical"))
            dtype = got.pop("dtype")
            params = got.pop("params")
            rows.update(got)
        ServerPool([url]).close()

    def med(name, key):
        return statistics.median(r[key] for r in rows[name])
    print(f"\nQwen3-MoE hidden {h}, {args.layers} layers, {args.experts} experts: {params / 1e6:.1f} M "
          f"parameters, {params * 2 / 1e6:.1f} MB in bf16; {args.layout.upper()} on 4 gloo ranks; one "
          f"{dtype} CPU SGLang server; {args.transport} transport; bucket {args.bucket_mb} MB; medians\n")
    print(f"| {'sync':<28} | {'senders':>7} | {'rank 0 MB':>9} | {'total MB':>8} | {'changed':>7} | "
          f"{'seconds':>7} | {'stream s':>8} | {'encode s':>8} | {'post s':>7} |")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 11}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
    for name in rows:
        parts = " | ".join(f"{med(name, k):>{w}.3f}" if k in rows[name][0] else f"{'':>{w}}"
                           for k, w in (("stream_seconds", 8), ("encode_seconds", 8), ("post_seconds", 7)))
        print(f"| {name:<28} | {med(name, 'senders'):>7.0f} | {med(name, 'rank0_bytes') / 1e6:>9.2f} | "
              f"{med(name, 'bytes') / 1e6:>8.2f} | {med(name, 'changed_fraction'):>7.4f} | "
              f"{med(name, 'seconds'):>7.3f} | {parts} |")
    old = "rank 0, full"
    new = next(k for k in (f"delta, lr {min(args.lrs):g}", f"delta, all checked, lr {min(args.lrs):g}") if k in rows)
    full_owners = med("owners, full", "bytes")
    changed = med(new, "changed_fraction")
    per_element = min(2.0, changed * 2 + min(4 * changed, 0.125))  # bytes per bf16 element
    print(f"\nProjection (bf16, {GBPS_PER_GPU:g} GB/s per sending GPU and per server GPU, the changed "
          f"fraction measured above at lr {min(args.lrs):g}: {changed:.4f} -> {per_element:.3f} bytes per "
          f"element):\n")
    print(f"| {'model':<16} | {'GB':>5} | {'trainer layout':<20} | {'rank 0 s':>8} | {'owners s':>8} | "
          f"{'delta s':>7} | peers (published) |")
    print(f"|{'-' * 18}|{'-' * 7}|{'-' * 22}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 19}|")
    for model, n, lay, senders, servers, peers in PROJECTED:
        gb = n * 2 / 1e9
        owners = max(gb / senders, gb / servers) / GBPS_PER_GPU
        delta = owners * per_element / 2
        print(f"| {model:<16} | {gb:>5.0f} | {lay:<20} | {gb / GBPS_PER_GPU:>8.1f} | {owners:>8.2f} | "
              f"{delta:>7.2f} | {peers} |")
    gib = 1 << 30
    print(f"\nfull sync by every owner: {full_owners / 1e6:.2f} MB; deltas at lr "
          f"{' / '.join(f'{lr:g}' for lr in args.lrs)}: "
          + ", ".join(f"{med(f'delta, all checked, lr {lr:g}', 'bytes') / full_owners:.3f} of it"
                      for lr in args.lrs))
    print(f"sync: rank-0 GiB {med(old, 'rank0_bytes') / gib:.4f} -> {med(new, 'rank0_bytes') / gib:.4f}, "
          f"total GiB {med(old, 'bytes') / gib:.4f} -> {med(new, 'bytes') / gib:.4f}, seconds "
          f"{med(old, 'seconds'):.3f} -> {med(new, 'seconds'):.3f}, bit-identical "
          f"{'yes' if all(identical) else 'no'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
