"""docs/extending.md runs as written: every fenced block whose info string is `bash recipe` is run in
order with `bash -euo pipefail` in one fresh folder outside the repository, as a user with the project
installed would (the folder on PYTHONPATH, REPO this checkout, the venv's bin first on PATH), one test
per block named by its section's heading. The blocks build one package of plug-ins, `my_ext/`, a row
of a table in each file, and end with a command that shows the plug-in used (listed by `gspo-megatron
config`, validated at load, the repository's property tests run over its row); the last trains two
steps with every one of them. A block that fails fails its test with its output; a later block then
fails too (they share the folder). No block may change a file of the repository: a plug-in is the
user's package, never an edit here. Slow: interpreters, reward workers, a GPU check's CPU smoke run,
a real SGLang server and a training run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "extending.md"
MAX_LINES = 370  # nine recipes with their whole code, about 35 lines each
# section -> lines its output must hold (what shows the plug-in used)
SAID = {
    "A loss": ["cispo: CISPO: clipped token weights kept out of the gradient", "12 passed"],
    "An advantage estimator with a setting of its own": [
        "grpo_std_floor: (S_i - mean_g) / max(std_g, floor) (settings: floor)",
        "| advantage=grpo_std_floor floor=0.05 |", "loss.estimator_args.floor=0.0: expected > 0", "1 passed"],
    "A KL estimator and a loss aggregation": ["13 passed"],
    "A weight-sync transport": ["toy: both owners posted through my_ext.toy_sync.ToySender", "1 passed"],
    "A model family, made of features": ["; mistral; specs checked: local", "| HF -> megatron -> HF | fp32 |"],
    "A prompt format": ["{'prompt': 'What is 1 plus 1? End with the number.', 'answer': '2'}"],
    "All of them in one run": [
        "listed: cispo grpo_std_floor near_number k3_capped seq-mean-token-sum-sqrt toy mistral csv",
        "[gspo] loss=cispo seq-mean-token-sum-sqrt eps_low=0.2 eps_high=0.28 kl_coef=0.01 (k3_capped) | "
        "advantage=grpo_std_floor floor=0.05", "[gspo] reward: near_number in 1 worker", "step    1/2 |",
        "the toy transport's reports: "],
}


def recipe_blocks(text: str) -> list[tuple[str, str]]:
    """(its section's heading, its text) of every ```bash recipe block, in the guide's order."""
    blocks: list[tuple[str, str]] = []
    body: list[str] = []
    heading, fence = "(before any section)", None
    for line in text.splitlines():
        if fence is None:
            if line.startswith("```"):
                fence, body = line[3:].strip(), []
            elif line.startswith("## "):
                heading = line[3:].strip()
        elif line.strip() == "```":
            if fence == "bash recipe":
                blocks.append((heading, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"docs/extending.md: a ``` fence is never closed (under {heading!r})"
    return blocks


BLOCKS = recipe_blocks(GUIDE.read_text())


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """The user's folder outside the repository, shared by the blocks in order."""
    return tmp_path_factory.mktemp("user")


def _repo_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize("section,block", [pytest.param(h, b, id=h) for h, b in BLOCKS])
def test_recipe_runs_as_written(section, block, user_folder):
    env = {**os.environ, "PYTHONPATH": str(user_folder), "PYTHONDONTWRITEBYTECODE": "1", "REPO": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("GSPO_PLUGINS", None)
    before = _repo_status()
    got = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=user_folder, env=env,
                         capture_output=True, text=True, timeout=1500)
    print(got.stdout[-3000:])
    assert got.returncode == 0, (f"exit {got.returncode}\n--- stdout\n{got.stdout[-6000:]}\n"
                                 f"--- stderr\n{got.stderr[-6000:]}")
    for needle in SAID.get(section, []):
        assert needle in got.stdout, (needle, got.stdout[-4000:])
    assert _repo_status() == before, f"{section}: the recipe changed files of the repository"


def test_the_guide_is_short_and_its_blocks_are_found():
    lines = GUIDE.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/extending.md has {len(lines)} lines (at most {MAX_LINES})"
    headings = [line for line in lines if line.startswith("## ")]
    assert len(headings) == len(set(headings)), headings  # a block's test is named by its heading
    assert set(SAID) <= {h for h, _ in BLOCKS}, set(SAID) - {h for h, _ in BLOCKS}
    assert recipe_blocks("## A\n```bash recipe\necho one\n```\n```python\nx = 1\n```\n## B\n"
                         "```bash recipe\necho two\n```\n") == [("A", "echo one\n"), ("B", "echo two\n")]
