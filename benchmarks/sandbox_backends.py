"""The code sandbox's backends side by side: what a run and a group cost, and the honest path.

    .venv/bin/python benchmarks/sandbox_backends.py                 # gvisor, namespaces, process
    .venv/bin/python benchmarks/sandbox_backends.py --runs 30 --groups 3 --backends gvisor namespaces

Columns, per backend (rollout.reward_args.isolation):
- run alone ms: one `sandbox.run` of a trivial stdin program outside any response (gVisor: a sandbox
  started for it and closed after), median of --runs;
- run in a response ms: the same inside one response's session (gVisor: its sandbox up already; the
  other backends: the same as alone, every run is a fresh sandbox), median;
- group s: one group of --group-size responses, each a program against 10 stdin tests, scored in
  turn by the code reward as a reward worker does (gVisor: a sandbox per response, the next one
  started while the current one's tests run), median of --groups; and per response;
- honest path: right 1.0 and wrong 0.0 on a stdin row and an fn_name row (1 when all four hold).
The machine's load matters: run it alone, and compare backends within one run (they alternate).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.rewards.code_reward import CodeReward  # noqa: E402
from rollout.rewards.settings import CodeSandboxSettings  # noqa: E402

PROGRAM = "print(int(input()) * 2)"
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
ROW = {"answer": {"inputs": [f"{t + 1} {3 * t}\n" for t in range(10)], "outputs": [f"{4 * t + 1}\n" for t in range(10)]}}
CALLS = {"answer": {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [[3], [10]]}}


def honest(reward: CodeReward) -> bool:
    return (reward.score(ROW, RIGHT), reward.score(ROW, WRONG),
            reward.score(CALLS, "```python\ndef add(a, b):\n    return a + b\n```"),
            reward.score(CALLS, "```python\ndef add(a, b):\n    return a * b\n```")) == (1.0, 0.0, 1.0, 0.0)


def measure(backend: Literal["gvisor", "namespaces", "process"], runs: int, groups: int,
            size: int) -> dict[str, Any]:
    reward = CodeReward(CodeSandboxSettings(isolation=backend, time_limit_s=4.0))
    note = reward.sandbox.probe()
    alone, inside, per_group = [], [], []
    for _ in range(runs):
        t = time.perf_counter()
        assert reward.sandbox.run(PROGRAM, b"21\n", 4.0).stdout == b"42\n"
        alone.append(time.perf_counter() - t)
    with reward.sandbox.session():
        for _ in range(runs):
            t = time.perf_counter()
            assert reward.sandbox.run(PROGRAM, b"21\n", 4.0).stdout == b"42\n"
            inside.append(time.perf_counter() - t)
    for _ in range(groups):
        t = time.perf_counter()
        scores = [reward.score(ROW, RIGHT if i % 2 == 0 else WRONG) for i in range(size)]
        per_group.append(time.perf_counter() - t)
        assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(size)], scores
    group = statistics.median(per_group)
    return {"alone_ms": 1000 * statistics.median(alone), "inside_ms": 1000 * statistics.median(inside),
            "group_s": group, "response_s": group / size, "honest": honest(reward), "note": note}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", nargs="+", default=["gvisor", "namespaces", "process"])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    print(f"| backend | run alone ms | run in a response ms | group of {args.group_size} x 10 tests s "
          "| per response s | honest path |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends:
        r = measure(backend, args.runs, args.groups, args.group_size)
        print(f"| {backend} | {r['alone_ms']:.0f} | {r['inside_ms']:.0f} | {r['group_s']:.2f} | "
              f"{r['response_s']:.2f} | {'exact' if r['honest'] else 'BROKEN'} |", flush=True)
        print(f"  ({r['note']})", file=sys.stderr)


if __name__ == "__main__":
    main()
