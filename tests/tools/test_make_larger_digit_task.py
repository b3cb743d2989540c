"""tools/make_larger_digit_task.py: the main job's task. The checked-in files are the tool's output,
no held-out prompt is a training prompt, and the warm start's solutions teach the format only
(a digit of the prompt, the larger one about half the time)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tools.make_larger_digit_task import make_larger_digit_task

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def test_checked_in_files_are_the_tools_output(tmp_path):
    paths = make_larger_digit_task(tmp_path)
    for name, path in paths.items():
        assert path.read_text() == (DATA / f"{name}.jsonl").read_text(), name


def test_held_out_phrasings_are_unseen_and_solutions_carry_the_format_only(tmp_path):
    paths = make_larger_digit_task(tmp_path)
    train = [json.loads(ln) for ln in paths["larger_digit_rl"].read_text().splitlines()]
    held = [json.loads(ln) for ln in paths["larger_digit_rl_eval"].read_text().splitlines()]
    assert len(train) == len(held) == 360
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    right = 0
    for r in train:
        digits = re.findall(r"\d", r["prompt"])
        boxed = re.fullmatch(r"\\boxed\{(\d)\}", r["solution"]).group(1)
        assert boxed in digits and r["answer"] == max(digits)
        right += boxed == r["answer"]
    assert 0.4 < right / len(train) < 0.6
    assert {r["data_source"] for r in held} == {"greater", "of_which", "higher", "or_which"}
