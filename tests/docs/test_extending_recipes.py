"""docs/extending.md runs as written: every fenced block whose info string is `bash recipe` is run
with `bash -euo pipefail` from the root of a fresh scratch copy of the repository (PYTHONPATH that
copy, the venv's bin first on PATH, so `python` is the project's), one test per block named by
its section's heading. A block writes its new files with heredocs and ends with a command that
shows the plug-in used; a nonzero exit fails it, with its output. Slow: each block starts fresh
interpreters in the copy, and some start reward workers, a server or a GPU check's CPU smoke run.

The copy is a git repository, so what a recipe touched is read afterwards: an extension point is a
module of its own and a row, so every library file a block adds or changes sits in one package
(a new family: one file of model_specs/families/; a transport: its module and one line of
sync/transports.py), and the sections in TOUCHED say exactly which files, with what the last
command must print.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "extending.md"
COPIED = ("gspo_errors", "gspo_megatron", "model_specs", "rollout", "tools", "tests", "examples",
          "benchmarks", "pyproject.toml")
MAX_LINES = 200
LIBRARY = ("gspo_errors", "gspo_megatron", "model_specs", "rollout", "tools")
# section -> (the library files the block leaves changed, as `git status --porcelain` lines; lines
# its output must hold)
TOUCHED = {
    "A weight-sync transport": ([" M gspo_megatron/sync/transports.py", "?? gspo_megatron/sync/toy.py"],
                                ["both owners posted through gspo_megatron.sync.toy.ToySender"]),
    "A model feature, and a family made of features": (["?? model_specs/families/mistral.py"],
                                                       ["; mistral; specs checked: local"]),
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


def _named(blocks: list[tuple[str, str]]) -> list:
    seen: dict[str, int] = {}
    out = []
    for heading, block in blocks:
        seen[heading] = seen.get(heading, 0) + 1
        name = heading if seen[heading] == 1 else f"{heading} #{seen[heading]}"
        out.append(pytest.param(heading, block, id=name))
    return out


BLOCKS = recipe_blocks(GUIDE.read_text())


def scratch_copy(dest: Path) -> Path:
    """The repository's code in `dest`, committed to a git repository of its own."""
    dest.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=recipe", "-c", "user.email=recipe@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "before the recipe"]):
        subprocess.run(git + args, cwd=dest, check=True)
    return dest


def touched(copy: Path) -> list[str]:
    """The library files the recipe added or changed, as `git status --porcelain` lines."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *LIBRARY],
                         cwd=copy, capture_output=True, text=True, check=True).stdout.splitlines()
    return sorted(line for line in out if line and "__pycache__" not in line)


@pytest.mark.slow
@pytest.mark.parametrize("section,block", _named(BLOCKS))
def test_recipe_runs_as_written(section, block, tmp_path):
    copy = scratch_copy(tmp_path / "repo")
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    got = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=1500)
    print(got.stdout[-3000:])
    assert got.returncode == 0, (f"exit {got.returncode}\n--- stdout\n{got.stdout[-6000:]}\n"
                                 f"--- stderr\n{got.stderr[-6000:]}")
    changed = touched(copy)
    assert len({str(Path(line[3:]).parent) for line in changed}) <= 1, (
        f"{section}: the recipe touched more than one package of the library: {changed}")
    if section in TOUCHED:
        files, said = TOUCHED[section]
        assert changed == sorted(files), changed
        for needle in said:
            assert needle in got.stdout, (needle, got.stdout[-4000:])
        for line in files:
            if line.startswith(" M "):  # a changed table: one row added, nothing else
                numstat = subprocess.run(["git", "diff", "--numstat", "--", line[3:]], cwd=copy,
                                         capture_output=True, text=True, check=True).stdout.split()
                assert numstat[:2] == ["1", "0"], (line, numstat)


def test_the_guide_is_short_and_its_blocks_are_found():
    lines = GUIDE.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/extending.md has {len(lines)} lines (at most {MAX_LINES})"
    headings = [line for line in lines if line.startswith("## ")]
    assert len(headings) == len(set(headings)), headings  # a block's test is named by its heading
    assert recipe_blocks("## A\n```bash recipe\necho one\n```\n```python\nx = 1\n```\n## B\n"
                         "```bash recipe\necho two\n```\n") == [("A", "echo one\n"), ("B", "echo two\n")]
