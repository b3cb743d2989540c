"""Make the counting task: a verifiable task whose correct responses are long, for measuring how
the policy loss behaves as responses grow (benchmarks/moe_stability.py, docs/moe_stability.md).

    python tools/make_counting_task.py --out runs/tasks/counting     # train.jsonl + eval.jsonl

A prompt asks to count down from a in steps of k; the worked-out response writes every
subtraction until what is left is smaller than k, and boxes it:

    prompt:   "Count down from 23 in steps of 7."
    solution: "23 - 7 = 16, 16 - 7 = 9, 9 - 7 = 2. \\boxed{2}"          answer: "2"

The answer (a mod k) is in no prompt, and a step skipped or repeated moves it; when to stop depends
only on the last result and k, which the tiny models learn in a short warm start. A step is 6
tokens of the tiny models' tokenizer, so responses run from about 10 to 270 tokens (mean about
80; every number stays below 89, one token each). The reward is `exact_match` on the boxed answer.
The warm start teaches the format from the `solution` field (train.warm_start_steps), as the main
job's does.

The rows are every (a, k) with 20 <= a <= 88 and k in 2..9; a row is held out (eval.jsonl) when a
hash of (a, k) falls in the held-out share, so the split is the same on every machine and no
training prompt appears in it. The order of train.jsonl is a seeded shuffle; the trainer shuffles
again with train.seed.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, run as a script
from tools.task_files import write_task_files  # noqa: E402

STARTS, STEPS = range(20, 89), range(2, 10)


def terms(a: int, k: int) -> list[int]:
    """a, a - k, ..., down to the first value below k (a mod k)."""
    return list(range(a, -1, -k))


def row(a: int, k: int) -> dict[str, str]:
    seq = terms(a, k)
    steps = ", ".join(f"{x} - {k} = {x - k}" for x in seq[:-1])
    return {"prompt": f"Count down from {a} in steps of {k}.", "answer": str(seq[-1]),
            "solution": f"{steps}. \\boxed{{{seq[-1]}}}"}


def held_out(a: int, k: int, share: float) -> bool:
    digest = hashlib.sha256(f"{a},{k}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def make_counting_task(out_dir: str | Path, held_out_share: float = 0.1, seed: int = 0,
                       starts: range = STARTS, steps: range = STEPS) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl into out_dir (created); returns their paths. `starts` and
    `steps` (subsets of the defaults: numbers stay one token) choose the rows, and so the lengths."""
    if not 0 < held_out_share < 1:
        raise ValueError(f"held_out_share={held_out_share}: expected a share in (0, 1)")
    if not (set(starts) <= set(STARTS) and set(steps) <= set(STEPS) and starts and steps):
        raise ValueError(f"starts={starts}, steps={steps}: expected non-empty subsets of {STARTS} and {STEPS}")
    train: list[dict] = []
    evaluation: list[dict] = []
    for k in steps:
        for a in starts:
            (evaluation if held_out(a, k, held_out_share) else train).append(row(a, k))
    random.Random(seed).shuffle(train)
    return write_task_files(out_dir, {"train": train, "eval": evaluation})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--held-out-share", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="the order of train.jsonl")
    args = p.parse_args(argv)
    for name, path in make_counting_task(args.out, args.held_out_share, args.seed).items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")


if __name__ == "__main__":
    main()
