"""Weight-sync time and throughput per transport, next to a plain safetensors write + read of the
same bytes on this machine.

    python benchmarks/sync.py                          # small Qwen3-MoE (~110 MB fp32), CPU
    python benchmarks/sync.py --hidden 1024 --layers 8 --experts 16 --bucket-mb 128

One trainer process (TP1; the stream's gathers are exercised by the tests, not here) and one real
SGLang server started for the run. Each transport syncs `--repeats` times (a new weight version
each time); the table gives the median. "safetensors write+read" is save_file of the full HF state
dict into the same directory the disk transport uses, then load_file of it; "stream only" is the
trainer side without any transport (gather to rank 0 + HF layout).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="disk,tensor,distributed")
    p.add_argument("--model", help="an HF Qwen3-MoE folder to sync instead of making one (--hidden ... ignored)")
    p.add_argument("--url", help="with --model: an SGLang server already serving it (its weights are replaced)")
    args = p.parse_args(argv)
    if args.url and not args.model:
        p.error("--url needs --model (the model the server serves)")

    import torch
    from safetensors.torch import load_file, save_file

    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.checkpoint.hf_files import copy_metadata_files
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import (DiskTransport, DistributedTransport, TensorTransport,
                                    WeightSync, build_plan, stream_hf_weights)
    from model_specs import load_hf_config
    from model_specs.hf_config import normalize_hf_config
    from model_specs.weight_maps import weight_map_for
    from rollout.pool import ServerPool
    from rollout.server import ServerConfig, ServerGroup
    from tools.make_tiny_model import make_tiny_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from distributed import free_port

    work = Path(tempfile.mkdtemp(prefix="gspo-bench-sync-"))
    h = args.hidden
    if args.model:
        model_dir = Path(args.model)
    else:
        model_dir = make_tiny_model("qwen3_moe", work / "hf", seed=0, hidden_size=h,
                                    intermediate_size=2 * h, moe_intermediate_size=h // 2,
                                    num_hidden_layers=args.layers, num_experts=args.experts,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=h // 8)
    hf = normalize_hf_config(load_hf_config(model_dir))
    h, args.layers, args.experts = hf["hidden_size"], hf["num_hidden_layers"], hf["num_experts"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    actor = Actor(hf, ParallelLayout())
    bucket_bytes = int(args.bucket_mb * (1 << 20))

    rows = []
    group = (ServerGroup.attach([args.url]) if args.url else
             ServerGroup.launch(ServerConfig(model_path=str(model_dir), device="cpu", startup_timeout_s=600)))
    with group:
        pool = ServerPool(group.server_urls)
        makers = {
            "disk": lambda: DiskTransport(pool, work / "disk", model_dir),
            "tensor": lambda: TensorTransport(pool),
            "distributed": lambda: DistributedTransport(pool, "127.0.0.1", free_port()),
        }
        for name in args.transports.split(","):
            transport = makers[name]()
            sync = WeightSync(actor.chunks, hf, transport, pool, bucket_bytes=bucket_bytes)
            reports = [sync.sync(version=f"{name}-{i}") for i in range(args.repeats)]
            transport.close()
            seconds = statistics.median(r["seconds"] for r in reports)
            nbytes = reports[0]["bytes"]
            rows.append((f"sync: {name}", nbytes, seconds, int(reports[0]["buckets"])))
        pool.close()

    # The stream alone (gather + HF layout, no server), then the same bytes through plain
    # safetensors on the same disk.
    wmap = weight_map_for(hf)
    plan = build_plan(actor.chunks, wmap)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        full = {n: t for bucket in stream_hf_weights(actor.chunks, wmap, plan, bucket_bytes)
                for n, t in bucket}
        times.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    rows.append(("stream only (no server)", nbytes, statistics.median(times), rows[0][3]))
    copy_metadata_files(model_dir, work / "plain")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        save_file(full, str(work / "plain" / "model.safetensors"))
        loaded = load_file(str(work / "plain" / "model.safetensors"))
        times.append(time.perf_counter() - start)
        del loaded
    rows.append(("safetensors write+read", nbytes, statistics.median(times), 1))

    print(f"\nQwen3-MoE hidden {h}, {args.layers} layers, {args.experts} experts; "
          f"{nbytes / 1e6:.1f} MB ({torch.get_num_threads()} threads); bucket {args.bucket_mb} MB; "
          f"median of {args.repeats}\n")
    print(f"| {'what':<24} | {'MB':>8} | {'seconds':>8} | {'GB/s':>6} | {'buckets':>7} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    for what, b, s, n in rows:
        print(f"| {what:<24} | {b / 1e6:>8.1f} | {s:>8.3f} | {b / s / 1e9:>6.3f} | {n:>7} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
