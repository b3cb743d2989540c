"""Reward throughput, and what scoring costs the rollout loop, inline against the reward workers.

    .venv/bin/python benchmarks/rewards.py                      # math short, math 4k-token CoT, code x10 tests
    .venv/bin/python benchmarks/rewards.py --workers 1 2 4 --groups 8 --group-size 8
    .venv/bin/python benchmarks/rewards.py --smoke              # the smallest size (the suite runs it)

Workloads (each group: one prompt, --group-size responses):
- math short:  `\\boxed{\\frac{3}{4}}`-style answers against MATH-style golds;
- math CoT:    a ~16k-character chain of thought (a 4k-token response) ending in a boxed answer;
- code:        a Python program against 10 stdin tests, each run in the sandbox (rollout/rewards/sandbox/run.py).
Defaults: 32 groups of 8 for math, 16 groups of 4 for code; the generation window below makes the
loop's share of scoring about one group's time over the step's, so more groups give a smaller share.

Columns:
- inline resp/s: one thread scoring every response in turn, in this process (what the rollout loop
  did before the workers: it scored each group as it finished, on the thread that feeds the servers);
- W workers resp/s: RewardWorkerPool with W processes, every group submitted at once;
- loop s inline / loop s W: the seconds the rollout loop spends on scoring when the step's groups
  finish evenly over a generation window as long as the inline scoring time (generation is
  represented by its timing here: a group is handed over at its finishing time). Inline the loop
  scores each group itself; with workers it only hands groups over and, after the last one, waits
  for what is still being scored (RolloutManager's time/reward_wait);
- projection: 8,192 responses per step (the paper's batch) at the measured single-worker cost,
  spread over 32 workers on the driver's node.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.rewards import RewardWorkerPool, get_reward  # noqa: E402

PAPER_RESPONSES = 8192
PROJECTED_WORKERS = 32


def math_short(g: int, size: int) -> tuple[dict, list[str]]:
    record = {"answer": rf"\dfrac{{{g % 7 + 1}}}{{{g % 5 + 2}}}"}
    return record, [rf"The answer is \boxed{{\frac{{{g % 7 + 1 + i % 2}}}{{{g % 5 + 2}}}}}." for i in range(size)]


def math_cot(g: int, size: int, chars: int = 16_000) -> tuple[dict, list[str]]:
    step = (r"Let $x_{k} = \frac{%d}{%d}$; then $x_{k}^2 + 2x_{k} = \frac{%d}{%d}$, so we keep "
            r"$\sqrt{%d}$ aside and continue with the next term of the sum. ")
    texts = []
    for i in range(size):
        parts: list[str] = []
        k = 0
        while sum(map(len, parts)) < chars:
            parts.append(step % (k + 1, k + 2, k * 3 + 1, (k + 2) ** 2, k + 2))
            k += 1
        texts.append("".join(parts) + rf"Therefore the answer is \boxed{{{g + i % 2}}}.")
    return {"answer": str(g)}, texts


def code_problem(g: int, size: int, tests: int = 10) -> tuple[dict, list[str]]:
    inputs = [f"{g + t} {t * 3}\n" for t in range(tests)]
    record = {"answer": {"inputs": inputs, "outputs": [f"{g + t + t * 3}\n" for t in range(tests)]}}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    return record, [right if i % 2 == 0 else wrong for i in range(size)]


# label -> (reward, make a group, groups, responses per group)
WORKLOADS = {"math short": ("math", math_short, 32, 8), "math CoT 16k chars": ("math", math_cot, 32, 8),
             "code, 10 stdin tests": ("code", code_problem, 16, 4)}


def inline(name: str, groups: list[tuple[dict, list[str]]]) -> tuple[float, list[float]]:
    """Score every response in turn in this thread; (total seconds, seconds per group)."""
    reward = get_reward(name)
    if reward.warm is not None:  # as the workers do: imports, the sandbox probe
        reward.warm()
    per_group = []
    for record, texts in groups:
        t0 = time.perf_counter()
        prepared = reward.prepare(record) if reward.prepare else None
        for text in texts:
            reward.score(record, text, prepared) if reward.prepare else reward.score(record, text)
        per_group.append(time.perf_counter() - t0)
    return sum(per_group), per_group


def pooled(name: str, groups: list[tuple[dict, list[str]]], workers: int, window_s: float) -> tuple[float, float, float]:
    """(responses/s with every group submitted at once, the loop's seconds on scoring when groups
    arrive evenly over `window_s`, p99 ms per response)."""
    with RewardWorkerPool(name, workers=workers, timeout_s=600) as pool:
        pool.wait_ready(every=True)  # each worker has imported and warmed its reward
        t0 = time.perf_counter()
        futures = [pool.submit(*_batch(g)) for g in groups]
        scores = [s for f in futures for s in f.result()]
        throughput = len(scores) / (time.perf_counter() - t0)
        loop = 0.0
        futures = []
        start = time.perf_counter()
        for k, g in enumerate(groups):
            arrival = start + window_s * (k + 1) / len(groups)
            time.sleep(max(0.0, arrival - time.perf_counter()))
            t = time.perf_counter()
            futures.append(pool.submit(*_batch(g)))
            loop += time.perf_counter() - t
        t = time.perf_counter()
        for f in futures:
            f.result()
        loop += time.perf_counter() - t
    seconds = sorted(s.seconds for s in scores)
    return throughput, loop, 1000 * seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]


def _batch(group: tuple[dict, list[str]]) -> tuple[list[dict], list[str]]:
    record, texts = group
    return [record] * len(texts), texts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--groups", type=int, default=None, help="groups per workload (default: 32 math, 16 code)")
    p.add_argument("--smoke", action="store_true", help="1 group of 2 per workload, 2 workers: the smallest size")
    p.add_argument("--group-size", type=int, help="responses per group (default: 8 math, 4 code)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.groups, args.group_size = [2], 1, 2
    rows: list[dict[str, Any]] = []
    print("| workload | responses | inline resp/s | inline ms/resp | " + " | ".join(
        f"{w} workers resp/s" for w in args.workers) + " | loop s inline | " + " | ".join(
        f"loop s {w}w" for w in args.workers) + f" | p99 ms ({args.workers[-1]}w) | "
        f"projected {PAPER_RESPONSES} resp: inline s | {PROJECTED_WORKERS} workers s |")
    print("|" + "---|" * (6 + 2 * len(args.workers)) + "---|")
    for label, (name, make, n_groups, size) in WORKLOADS.items():
        groups = [make(g, args.group_size or size) for g in range(args.groups or n_groups)]
        n = sum(len(t) for _, t in groups)
        total, _ = inline(name, groups)
        results = {w: pooled(name, groups, w, window_s=total) for w in args.workers}
        per = total / n
        row = {"workload": label, "responses": n, "inline_resp_per_s": n / total, "inline_ms": 1000 * per,
               "workers": {w: {"resp_per_s": r[0], "loop_s": r[1], "p99_ms": r[2]} for w, r in results.items()},
               "loop_s_inline": total, "projected_inline_s": PAPER_RESPONSES * per,
               "projected_workers_s": PAPER_RESPONSES * per / PROJECTED_WORKERS}
        rows.append(row)
        print(f"| {label} | {n} | {n / total:.1f} | {1000 * per:.1f} | "
              + " | ".join(f"{r[0]:.1f}" for r in results.values())
              + f" | {total:.2f} | " + " | ".join(f"{r[1]:.3f}" for r in results.values())
              + f" | {results[args.workers[-1]][2]:.1f} | {PAPER_RESPONSES * per:.0f} | "
              f"{PAPER_RESPONSES * per / PROJECTED_WORKERS:.1f} |", flush=True)
    worst = max(r["workers"][args.workers[-1]]["loop_s"] / r["loop_s_inline"] for r in rows)
    print(f"rewards: the rollout loop's scoring time with {args.workers[-1]} workers is at most "
          f"{100 * worst:.1f}% of inline (goal <= 10%)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
