"""Synchronous against asynchronous RL on the main job's configuration: step time, busy fractions,
overlap, staleness, reward.

    .venv/bin/python benchmarks/async.py                      # max_staleness 0, 1, 2; 100 steps each
    .venv/bin/python benchmarks/async.py --staleness 0 1 --steps 30

Each run is `gspo-megatron train examples/tiny_moe_larger_digit.yaml --set train.max_staleness=N`
in its own folder, attached to one real SGLang server started here (CPU; the tiny MoE of
scripts/main_job.sh, made if missing). Per run, over the steps after --skip warm-up steps (medians):
- step s: time/step;
- rollout s: seconds the rollout side generated during a step (synchronous: time/rollout; async:
  async/rollout_busy x step);
- train+sync s: time/log_probs + time/train + time/sync;
- overlap: fraction of the step both were busy (async/overlap);
- step / max(rollout, train+sync): 1.0 is perfect overlap; the synchronous loop is near
  (rollout + train + sync) / max(...);
- staleness: mean and max of async/staleness_*; reward at the first and the last step.
On a 2-core CPU machine the SGLang server and the trainer share the cores, so overlapping them
cannot beat the sum of their CPU time; the table shows what the loop itself costs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = "examples/tiny_moe_larger_digit.yaml"
MODEL = ROOT / "runs" / "models" / "tiny-qwen3-moe"


def _median(records: list[dict], key: str, skip: int) -> float:
    vals = [r[key] for r in records[skip:] if key in r]
    return statistics.median(vals) if vals else float("nan")


def run_one(n: int, url: str, work: Path, steps: int, extra: list[str]) -> dict:
    from gspo_megatron.run.metrics import read_jsonl
    run = work / f"staleness{n}"
    sets = {"model.hf_path": str(MODEL), "rollout.server_urls": f"[{url}]", "train.steps": steps,
            "train.max_staleness": n, "checkpoint.dir": str(run / "ckpt"), "checkpoint.export_hf": "null",
            "logging.tensorboard_dir": str(run / "tb"), "logging.progress": "false"}
    cmd = [str(ROOT / ".venv" / "bin" / "gspo-megatron"), "train", CONFIG,
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")], *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"max_staleness={n}: the run failed:\n{proc.stderr[-3000:]}")
    return {"n": n, "records": read_jsonl(run / "tb" / "metrics.jsonl", steps_only=True)}


def summarise(r: dict, skip: int) -> dict:
    rec = r["records"]
    for x in rec:
        x["train_sync"] = sum(x.get(k, 0.0) for k in ("time/log_probs", "time/train", "time/sync",
                                                       "time/ref_log_probs", "time/routing_drift"))
        x["rollout_s"] = x["async/rollout_busy"] * x["time/step"] if "async/rollout_busy" in x else x["time/rollout"]
        x["ratio"] = x["time/step"] / max(x["rollout_s"], x["train_sync"])
    return dict(n=r["n"], step=_median(rec, "time/step", skip), rollout=_median(rec, "rollout_s", skip),
                train=_median(rec, "train_sync", skip), ratio=_median(rec, "ratio", skip),
                overlap=_median(rec, "async/overlap", skip) if r["n"] else 0.0,
                stale_mean=statistics.fmean(x.get("async/staleness_mean", 0.0) for x in rec),
                stale_max=max(x.get("async/staleness_max", 0.0) for x in rec),
                reward0=rec[0]["rollout/reward_mean"], reward=rec[-1]["rollout/reward_mean"],
                last=rec[-1]["step"], wall=sum(x["time/step"] for x in rec))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    p.add_argument("--set", dest="extra", action="append", default=[], help="more overrides")
    p.add_argument("--url", help="attach to this SGLang server (serving the tiny MoE) instead of starting one")
    args = p.parse_args(argv)
    from rollout.servers.launch import ServerConfig, ServerGroup
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--arch", "qwen3_moe", "--out", str(MODEL),
                        "--seed", "0"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="gspo-bench-async-"))
    rows = []
    try:
        group = (ServerGroup.attach([args.url]) if args.url
                 else ServerGroup.launch(ServerConfig(model_path=str(MODEL), device="cpu")))
        with group:
            for n in args.staleness:
                extra = [a for kv in args.extra for a in ("--set", kv)]
                rows.append(summarise(run_one(n, group.server_urls[0], work, args.steps, extra), args.skip))
                print(f"max_staleness={n}: done ({rows[-1]['wall']:.0f} s of steps)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{CONFIG}, {args.steps} steps, medians over steps {args.skip}-{args.steps - 1}, one CPU SGLang server")
    print("| max_staleness | step s | rollout s | train+sync s | step / max(rollout, train+sync) | overlap "
          "| staleness mean / max | reward step 0 -> last | steps wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} | {r['ratio']:.2f} | "
              f"{r['overlap']:.2f} | {r['stale_mean']:.2f} / {r['stale_max']:.0f} | "
              f"{r['reward0']:.3f} -> {r['reward']:.3f} (step {r['last']}) | {r['wall']:.0f} |")


if __name__ == "__main__":
    main()
