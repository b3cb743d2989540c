"""What checkpoint checksums cost: a training checkpoint (model + Adam state) saved and verified with
and without the per-file CRC32 of the manifest (checkpoint.verify_checksums).

    .venv/bin/python benchmarks/checksum.py                         # benchmarks/sync.py's larger model
    .venv/bin/python benchmarks/checksum.py --hidden 512 --layers 4 --experts 8

The default model is the one `benchmarks/sync.py --hidden 1024 --layers 8 --experts 16` syncs
(911 MB of fp32 weights); its training checkpoint holds the weights and Adam's two moments. One
process (TP1). Each figure is the median of --repeats; the page cache is warm (the files were just
written), as at save time, where each rank checksums its own files right after writing them; a
resume reads them cold from the checkpoint's storage, which a CRC32 at ~6 GB/s does not slow down
(the read itself is the cost).
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
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    import torch

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.batching.batch import TrainBatch
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager, file_crc32
    from gspo_megatron.parallel.layout import ParallelLayout
    from tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="gspo-bench-checksum-"))
    h = args.hidden
    model_dir = make_tiny_model("qwen3_moe", work / "hf", seed=0, hidden_size=h, intermediate_size=2 * h,
                                moe_intermediate_size=h // 2, num_hidden_layers=args.layers,
                                num_experts=args.experts, num_attention_heads=8, num_key_value_heads=4,
                                head_dim=h // 8)
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    actor = Actor(str(model_dir), ParallelLayout(), optimizer=OptimizerSettings(lr=1e-6),
                  loss=LossSettings(name="gspo"), micro_batch_size=4)
    g = torch.Generator().manual_seed(0)
    t = torch.arange(32)[None]
    batch = TrainBatch(tokens=torch.randint(0, 512, (4, 32), generator=g), lengths=torch.full((4,), 32),
                       loss_mask=t.expand(4, 32) >= 8, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    shard = actor.shard(batch)
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    actor.train_step(shard)  # Adam state exists

    CheckpointManager(work / "warm-up", keep=0).save(1, actor, LoopState(step=1))  # first-write costs
    times: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    size = 0
    for rep in range(args.repeats):
        for checksums in (False, True):  # interleaved: the disk's mood hits both alike
            root = work / f"ck-{checksums}-{rep}"
            ckpt = CheckpointManager(root, keep=0, checksums=checksums)
            t0 = time.perf_counter()
            path = ckpt.save(1, actor, LoopState(step=1))
            times[checksums][0].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt.verify(path, checksums=checksums)
            times[checksums][1].append(time.perf_counter() - t0)
            size = ckpt.size_bytes(path) or 0
            if rep:
                shutil.rmtree(root)
    rows = {k: (statistics.median(s), statistics.median(v)) for k, (s, v) in times.items()}
    files = sorted(p for p in (work / "ck-True-0").rglob("*") if p.is_file())
    t0 = time.perf_counter()
    for f in files:
        file_crc32(f)
    crc_alone = time.perf_counter() - t0
    actor.close()
    shutil.rmtree(work, ignore_errors=True)

    print(f"\nmodel: hidden {h}, {args.layers} layers, {args.experts} experts: {weights / 1e6:,.0f} MB of "
          f"fp32 weights; training checkpoint {size / 1e6:,.0f} MB in {len(files)} files; median of {args.repeats}")
    print("| checkpoint.verify_checksums | save s | verify at resume s | save GB/s |")
    print("|---|---|---|---|")
    for checksums in (False, True):
        s, v = rows[checksums]
        print(f"| {str(checksums).lower()} | {s:.2f} | {v:.3f} | {size / s / 1e9:.2f} |")
    extra = rows[True][0] - rows[False][0]
    print(f"CRC32 of every file alone (warm cache): {crc_alone:.2f} s ({size / crc_alone / 1e9:.1f} GB/s); "
          f"cost at save: {extra:+.2f} s ({100 * extra / rows[False][0]:+.0f}%)")


if __name__ == "__main__":
    main()
