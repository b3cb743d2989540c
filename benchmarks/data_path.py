"""The rollout batch's way from rank 0 to the ranks that train it: the packed per-rank path against
the old one (the whole padded batch pickled to every rank), on real gloo ranks (fresh processes
per measurement).

    python benchmarks/data_path.py                       # DP4, 1,024 rows both paths; 2,048 and 8,192 new only
    python benchmarks/data_path.py --rows 64 --old-rows 64 --r3-rows 32 --max-len 2000 --dp 2 --layers 4
                                                         # the smoke size

before: rank 0 pickles the whole right-padded TrainBatch and broadcasts it (broadcast_object_list);
        each rank keeps its rows, cut by row count (dp_balance=rows)
after:  actor/batching/transfer.py: each mini-batch's rows shared by work (Karmarkar-Karp on FLOPs at
        Qwen3-30B-A3B's shape), each rank sent only its rows, packed (one byte buffer), kept packed
        (the driver builds the batch packed too: driver/samples_to_batch.py)

Rows: a 512-token prompt plus a lognormal response (median ~1.5k tokens), capped at --max-len;
the fields a rollout fills (tokens, loss mask, rollout log-probs, weight versions), 4 mini-batches.
Per path and size it prints: the bytes the fullest rank received, that rank's own rows' real
tokens in bytes, the peak RSS a rank grew by during the transfer (rank 0 aside: it builds the
batch), the time from rank 0's first byte to the last rank holding its rows (ranks start together
after a barrier) and the worst mini-batch's DP token imbalance. Sizes the old path does not run
are projected from its measured rows (bytes and time grow with rows x longest row).

Routing replay (R3), --r3-rows (2,048): the new path on DP2 x PP2 (4 ranks: 2 replicas of 2
pipeline stages) with the engine's routes at Qwen3-30B-A3B's shape (--layers 48 x top-8): each
stage receives its own half of the layers. Per rank it prints what the received batch holds
(TrainBatch.nbytes: every tensor it keeps) against its own rows' real tokens x (the fields + its
own layers' routes, one byte per expert id); and what the driver holds of the step's routes (once,
compact: one byte per expert id and real token). The old path cannot run it (int16 [rows, longest,
layers, k] on every rank): projected. Both are projected to 8,192 rows (they grow with real tokens).
"""
from __future__ import annotations

import argparse
import pickle
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from distributed import run_distributed  # noqa: E402  (the tests' gloo launcher)

GiB = 2**30
MINI = 4


def lengths_for(rows: int, max_len: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [min(max_len, 512 + int(r.lognormvariate(7.3, 1.0))) for _ in range(rows)]


def build_packed(lengths: list[int], layers: int = 0, topk: int = 8):
    """The driver's batch as driver/samples_to_batch.py builds it: packed, routes compact."""
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch, positions_in_rows
    lens = torch.tensor(lengths)
    total = int(lens.sum())
    trained = positions_in_rows(lens) >= 512
    routes = torch.randint(0, 128, (total, layers, topk), dtype=torch.uint8) if layers else None
    return TrainBatch(tokens=torch.randint(1, 150000, (total,)), lengths=lens, loss_mask=trained,
                      advantages=torch.randn(len(lengths)),
                      rollout_log_probs=torch.where(trained, -torch.rand(total), 0.0),
                      weight_versions=torch.where(trained, 7, -1), routed_experts=routes)


def build_batch(lengths: list[int]):
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    n, s = len(lengths), max(lengths)
    lens = torch.tensor(lengths)
    real = torch.arange(s)[None, :] < lens[:, None]
    trained = real & (torch.arange(s)[None, :] >= 512)
    return TrainBatch(tokens=torch.where(real, torch.randint(1, 150000, (n, s)), 0), lengths=lens,
                      loss_mask=trained, advantages=torch.randn(n),
                      rollout_log_probs=torch.where(trained, -torch.rand(n, s), 0.0),
                      weight_versions=torch.where(trained, 7, -1))


def own_real_bytes(shard) -> int:
    """Bytes of a shard's real tokens (each per-token field, routes at one byte per expert id of
    the layers it holds) and its per-row fields."""
    real = int(shard.lengths.sum())
    per_token = sum(t.element_size() for t in (shard.tokens, shard.loss_mask, shard.rollout_log_probs,
                                               shard.weight_versions))
    if shard.routed_experts is not None:
        per_token += shard.routed_experts.shape[-2] * shard.routed_experts.shape[-1]
    return real * per_token + shard.num_rows * (8 + 8 + shard.advantages.element_size())


def flops_work():
    from gspo_megatron.actor.batching.balance import row_work
    from model_specs.param_count import param_count
    from model_specs.hf.published import QWEN3_30B_A3B
    from model_specs.shape import model_shape_for
    shape = model_shape_for(QWEN3_30B_A3B)
    c = shape.config
    active, width = param_count(shape).active, c.num_layers * c.num_attention_heads * c.kv_channels
    return lambda lengths: row_work(lengths, "flops", active_params=active, attention_width=width)


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, path: str, lengths: list[int], layers: int) -> dict | None:
    """One gloo rank (run_distributed starts it, joined to the group); rank 0 returns the figures."""
    import torch.distributed as dist

    from gspo_megatron.actor.batching.balance import plan_shards, worst_imbalance
    from gspo_megatron.parallel.rank_zero import broadcast_object
    # R3 (layers > 0): DP2 x PP2, ranks 2d and 2d + 1 the two stages of replica d
    dp_rank, dp_size = (rank // 2, world // 2) if layers else (rank, world)
    own_layers = (list(range(layers // 2)) if rank % 2 == 0 else list(range(layers // 2, layers))) \
        if layers else None
    if rank == 0:
        batch = build_batch(lengths) if path == "before" else build_packed(lengths, layers)
    else:
        batch = None
    driver_routes = batch.routed_experts.nbytes if rank == 0 and layers else 0
    work = flops_work()
    dist.barrier()
    rss0 = rss_bytes()
    start = time.time()
    if path == "before":
        received = broadcast_object(batch)
        shard = received.shard(rank, world, MINI)
        sent = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)) if rank == 0 else 0
        plan = plan_shards(len(lengths), world, MINI)
        del received
    else:
        from gspo_megatron.actor.batching.transfer import scatter_rows
        got = scatter_rows(rank, lambda: (batch, None), dp_rank=dp_rank, dp_size=dp_size,
                           num_mini_batches=MINI, work=work, route_layers=own_layers)
        if got is None:
            raise RuntimeError("scatter_rows gave this rank no shard")
        shard, _, stats = got
        sent = int(stats["bytes_per_rank"])
        plan = plan_shards(len(lengths), dp_size, MINI, work(lengths))
    held = time.time()
    imbalance = worst_imbalance(lengths, plan)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, dict(held=held, grew=rss_bytes() - rss0, own=own_real_bytes(shard),
                                          keeps=shard.nbytes()))
    if rank != 0:
        return None
    others = everyone[1:]
    return dict(seconds=max(e["held"] for e in everyone) - start, received=sent,
                own=max(e["own"] for e in everyone), grew=max(e["grew"] for e in others),
                keeps_over_own=max(e["keeps"] / e["own"] for e in others),
                keeps=max(e["keeps"] for e in others), imbalance=imbalance, driver_routes=driver_routes)


def measure(path: str, lengths: list[int], world: int, layers: int = 0) -> dict:
    """Rank 0's figures of one path. The tests' launcher runs the ranks: a rendezvous port below the
    ephemeral range, and a rank's death or a hang past the bound ends the run naming the rank."""
    return run_distributed(_rank, world, (path, lengths, layers), timeout=1800)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1024,2048,8192", help="batch sizes (comma-separated) of the new path")
    p.add_argument("--old-rows", default="1024", help="batch sizes the old path also runs")
    p.add_argument("--max-len", type=int, default=20000, help="longest row (prompt + response)")
    p.add_argument("--dp", type=int, default=4, help="data-parallel ranks (gloo processes)")
    p.add_argument("--r3-rows", type=int, default=2048, help="rows of the R3 run (DP2 x PP2); 0: none")
    p.add_argument("--layers", type=int, default=48, help="MoE layers of the R3 routes (top-8 each)")
    p.add_argument("--project", type=int, default=8192, help="rows the R3 figures are projected to")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sizes = sorted({int(x) for x in args.rows.split(",")} | {int(x) for x in args.old_rows.split(",")})
    old_sizes = {int(x) for x in args.old_rows.split(",")}
    print(f"DP{args.dp} gloo ranks, lognormal lengths up to {args.max_len}, {MINI} mini-batches\n")
    print("| rows | path | longest | received GiB (fullest rank) | own real GiB | received / own "
          "| RSS growth GiB | transfer s | DP token imbalance |")
    print("|---|---|---|---|---|---|---|---|---|")
    old_per_cell: tuple[float, float] | None = None   # (bytes, seconds) per padded cell
    done: dict[tuple[int, str], dict] = {}
    for rows in sizes:
        lengths = lengths_for(rows, args.max_len, args.seed)
        cells = rows * max(lengths)
        for path in ("before", "after"):
            if path == "before" and rows not in old_sizes:
                if old_per_cell:
                    b, s = old_per_cell
                    print(f"| {rows:,} | before (projected) | {max(lengths)} | {b * cells / GiB:.2f} | - | - | - "
                          f"| {s * cells:.1f} | - |")
                continue
            if path == "after" and rows not in {int(x) for x in args.rows.split(",")}:
                continue
            r = measure(path, lengths, args.dp)
            if path == "before":
                old_per_cell = (r["received"] / cells, r["seconds"] / cells)
            done[(rows, path)] = r
            print(f"| {rows:,} | {path} | {max(lengths)} | {r['received'] / GiB:.3f} | {r['own'] / GiB:.3f} | "
                  f"{r['received'] / r['own']:.2f} | {r['grew'] / GiB:.2f} | {r['seconds']:.2f} | "
                  f"{r['imbalance']:.3f} |", flush=True)
    if args.r3_rows:
        routing_replay(args)
    both = [rows for rows in sizes if (rows, "before") in done and (rows, "after") in done]
    if both:
        was, now = done[(both[-1], "before")], done[(both[-1], "after")]
        print(f"\ndata path: per-rank GiB {was['received'] / GiB:.3f} -> {now['received'] / GiB:.3f}, "
              f"transfer s {was['seconds']:.2f} -> {now['seconds']:.2f}, "
              f"DP token imbalance {was['imbalance']:.3f} -> {now['imbalance']:.3f} (at {both[-1]:,} rows)")


def routing_replay(args) -> None:
    rows, layers, topk = args.r3_rows, args.layers, 8
    lengths = lengths_for(rows, args.max_len, args.seed)
    print(f"\nRouting replay: DP2 x PP2 (4 gloo ranks), routes {layers} layers x top-{topk}, "
          f"each stage its {layers // 2} layers\n")
    print("| rows | longest | batch held GiB (fullest rank, driver aside) | own real GiB | held / own "
          "| RSS growth GiB | transfer s | driver's routes GiB (compact) | old path per rank GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    r = measure("after", lengths, 4, layers)
    real = sum(lengths)
    compact = real * layers * topk
    assert r["driver_routes"] == compact, (r["driver_routes"], compact)  # once, a byte per id
    def old_path(lengths):  # every rank: int16 routes and the 21 bytes of fields, padded
        return len(lengths) * max(lengths) * (layers * topk * 2 + 21)
    old = old_path(lengths)
    print(f"| {rows:,} | {max(lengths)} | {r['keeps'] / GiB:.3f} | {r['own'] / GiB:.3f} | "
          f"{r['keeps_over_own']:.2f} | {r['grew'] / GiB:.2f} | {r['seconds']:.2f} | "
          f"{r['driver_routes'] / GiB:.3f} | {old / GiB:.1f} (projected) |")
    big = lengths_for(args.project, args.max_len, args.seed)
    k = sum(big) / real  # the figures grow with real tokens
    old_big = old_path(big)
    print(f"| {args.project:,} (projected) | {max(big)} | {r['keeps'] * k / GiB:.3f} | {r['own'] * k / GiB:.3f} | "
          f"{r['keeps_over_own']:.2f} | {r['grew'] * k / GiB:.2f} | {r['seconds'] * k:.1f} | "
          f"{sum(big) * layers * topk / GiB:.3f} | {old_big / GiB:.1f} |", flush=True)
    print(f"\nrouting replay: per-rank batch GiB {r['keeps'] / GiB:.3f} = {r['keeps_over_own']:.2f} x own "
          f"(old path {old / GiB:.1f} projected), driver's routes {r['driver_routes'] / GiB:.3f} GiB once "
          f"(at {rows:,} rows)")


if __name__ == "__main__":
    main()
