"""Make the main job's task (examples/tiny_moe_larger_digit.yaml): which of two digits is larger.

    python tools/make_larger_digit_task.py --out examples/data     # larger_digit_rl.jsonl + larger_digit_rl_eval.jsonl

Training prompts: every ordered pair of distinct digits (90) in four phrasings (360 rows). Held
out: the same pairs in four other phrasings (360 rows, `data_source` names the phrasing), so a
greedy eval asks whether the policy learned to compare digits or learned its training sentences.

The warm start (train.warm_start_steps) trains on each row's `solution`. It is the answer format
only: `\\boxed{d}` with d one of the row's two digits, picked by a hash of the row, right half of the
time. The warm policy therefore answers in the format and picks a digit of the prompt, at chance
(about 0.5 greedy, held out); what it knows of "larger" after RL, RL taught it. The reward is
`exact_match` against `answer`, the larger digit.

examples/data/larger_digit.jsonl (one phrasing, solutions that give the answer) is the older form
of the task, kept for the tests' warm-started fixtures and the peers' example configs.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, run as a script
from tools.task_files import write_task_files  # noqa: E402

TRAIN_PHRASINGS = ("Which is larger: {a} or {b}?", "Which is bigger: {a} or {b}?",
                   "Of {a} and {b}, which is bigger?", "Pick the larger of {a} and {b}.")
EVAL_PHRASINGS = {"greater": "Which is greater: {a} or {b}?", "of_which": "Of {a} and {b}, which is larger?",
                  "higher": "Which one is higher: {a} or {b}?", "or_which": "{a} or {b}, which is greater?"}


def format_pick(a: int, b: int, phrasing: int) -> int:
    """The digit the warm start's solution boxes: a or b, by a hash (the same on every machine)."""
    return (a, b)[hashlib.sha256(f"{a},{b},{phrasing}".encode()).digest()[0] % 2]


def make_larger_digit_task(out_dir: str | Path) -> dict[str, Path]:
    """Write larger_digit_rl.jsonl and larger_digit_rl_eval.jsonl into out_dir; returns their paths."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    train = [{"prompt": text.format(a=a, b=b), "answer": str(max(a, b)),
              "solution": f"\\boxed{{{format_pick(a, b, k)}}}"}
             for k, text in enumerate(TRAIN_PHRASINGS) for a, b in pairs]
    held_out = [{"prompt": text.format(a=a, b=b), "answer": str(max(a, b)), "data_source": source}
                for source, text in EVAL_PHRASINGS.items() for a, b in pairs]
    return write_task_files(out_dir, {"larger_digit_rl": train, "larger_digit_rl_eval": held_out})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    args = p.parse_args(argv)
    for name, path in make_larger_digit_task(args.out).items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")


if __name__ == "__main__":
    main()
