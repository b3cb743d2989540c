"""Loading large prompt sets: time and peak memory for parquet sets of 10k, 100k and 1M rows.

    .venv/bin/python benchmarks/data.py                     # 10k, 100k, 1M rows of ~500-character prompts
    .venv/bin/python benchmarks/data.py --rows 10000 --chars 200

Each set is generated (verl's layout: a chat-message `prompt`, `reward_model.ground_truth`,
`data_source`, `extra_info`) as parquet shards of 100k rows, batch by batch. Then a fresh process
does what a run does with it and reports its time and peak RSS (ru_maxrss): open and validate the
set (rollout.prompts.sets: a streaming pass over the parquet), fingerprint it (checkpoint record),
convert it once into a memory-mapped Arrow file (the driver's cache; "first load"), build the
seeded epoch order (PromptStream) and read 1,000 records in that order; and once more with the
cache in place ("cached load"). Target: peak RSS <= 300 MB at 1M rows.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GENERATE = r"""
import sys, pyarrow as pa, pyarrow.parquet as pq
out, rows, chars = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
words = ("what is the larger digit of the two below please answer with a boxed number " * 20)
shard = 100_000
for k, start in enumerate(range(0, rows, shard)):
    n = min(shard, rows - start)
    ids = range(start, start + n)
    table = pa.table({
        "prompt": [[{"role": "user", "content": f"{i}: " + words[i % 97:i % 97 + chars]}] for i in ids],
        "reward_model": [{"ground_truth": str(i % 10), "style": "rule"} for i in ids],
        "data_source": [f"source{i % 3}" for i in ids],
        "extra_info": [{"index": i, "split": "train"} for i in ids]})
    pq.write_table(table, f"{out}/train-{k:05d}-of-{(rows + shard - 1) // shard:05d}.parquet")
"""

MEASURE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
t0 = time.perf_counter()
from rollout.prompts.sets import open_prompt_set, prompt_set_fingerprint
from rollout.prompts.dataset import PromptStream
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
ps = open_prompt_set(sys.argv[1], answer_key="reward_model.ground_truth", cache_dir=sys.argv[2])
t_open = time.perf_counter() - t0
t0 = time.perf_counter()
fp = prompt_set_fingerprint(ps.files(), len(ps))
t_hash = time.perf_counter() - t0
t0 = time.perf_counter()
ps[0]  # the driver's first read: the Arrow cache is made here the first time
t_cache = time.perf_counter() - t0
t0 = time.perf_counter()
stream = PromptStream(ps, seed=1234)
recs = [next(stream) for _ in range(1000)]
t_read = time.perf_counter() - t0
assert all(r["answer"] is not None and r["prompt"] for r in recs)
print(json.dumps(dict(rows=len(ps), bytes=fp["bytes"], t_import=t_import, t_open=t_open, t_hash=t_hash,
                      t_cache=t_cache, t_read=t_read,
                      rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def measure(folder: Path, cache: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(cache), str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--chars", type=int, default=500)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gspo-bench-data-"))
    out = []
    try:
        for rows in args.rows:
            folder = work / f"set{rows}"
            folder.mkdir()
            subprocess.run([sys.executable, "-c", GENERATE, str(folder), str(rows), str(args.chars)], check=True)
            first = measure(folder, work / f"cache{rows}")
            again = measure(folder, work / f"cache{rows}")
            out.append((rows, first, again))
            shutil.rmtree(folder)
            shutil.rmtree(work / f"cache{rows}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nparquet sets of ~{args.chars}-character chat prompts (verl layout), shards of 100k rows; one fresh "
          "process per load")
    print("| rows | parquet MB | open + validate s | fingerprint s | first read (Arrow cache) s | 1k records s "
          "| peak RSS MB, first load | peak RSS MB, cached load |")
    print("|---|---|---|---|---|---|---|---|")
    for rows, a, b in out:
        print(f"| {rows:,} | {a['bytes'] / 1e6:,.0f} | {a['t_open']:.2f} | {a['t_hash']:.2f} | {a['t_cache']:.2f} "
              f"(cached: {b['t_cache']:.2f}) | {a['t_read']:.2f} | {a['rss_mb']:.0f} | {b['rss_mb']:.0f} |")
    print(f"(import of the loader: {out[0][1]['t_import']:.2f} s)")


if __name__ == "__main__":
    main()
