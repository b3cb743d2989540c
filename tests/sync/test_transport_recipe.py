"""docs/extending.md's weight-sync transport recipe runs as written: its `bash recipe` block, in a
scratch copy of the repository, writes a toy transport in a module of its own, adds its row to
TRANSPORTS with one line, and its last command shows the every-owner path using the toy's Sender,
with and without deltas, against a real SGLang server (tests/sync/transport_check.py). The copy's
`git diff` afterwards: the new module and one changed line of gspo_megatron/sync/, nothing else
of the library.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("gspo_errors", "gspo_megatron", "model_specs", "rollout", "tools", "tests", "examples",
          "benchmarks", "pyproject.toml")


def recipe(section: str) -> str:
    """The one `bash recipe` block of docs/extending.md's section `section`."""
    text = (ROOT / "docs" / "extending.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"^```bash recipe\n(.*?)^```$", text[start:end if end > 0 else None], re.S | re.M)
    assert len(blocks) == 1, f"{section}: {len(blocks)} `bash recipe` blocks, expected one"
    return blocks[0]


@pytest.mark.slow
def test_the_transport_recipe_runs_as_written(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, copy / name, ignore=ignore) if src.is_dir() else shutil.copy(src, copy / name))
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    subprocess.run(["git", "add", "-A"], cwd=copy, check=True)
    subprocess.run(["git", "-c", "user.name=recipe", "-c", "user.email=recipe@localhost", "commit", "-q",
                    "-m", "the repository before the recipe"], cwd=copy, check=True)
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    got = subprocess.run(["bash", "-e", "-c", recipe("A weight-sync transport")], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    said = [line for line in got.stdout.splitlines() if line.startswith("toy: ")]
    print(said)
    assert said and "both owners posted through gspo_megatron.sync.toy.ToySender" in said[0], got.stdout[-4000:]
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "gspo_errors",
                              "gspo_megatron", "model_specs", "rollout", "tools"], cwd=copy,
                             capture_output=True, text=True, check=True).stdout.split("\n")
    assert sorted(line for line in changed if line and "__pycache__" not in line) == [" M gspo_megatron/sync/transports.py",
                                                        "?? gspo_megatron/sync/toy.py"], changed
    diff = subprocess.run(["git", "diff", "--numstat", "--", "gspo_megatron/sync/transports.py"], cwd=copy,
                          capture_output=True, text=True, check=True).stdout.split()
    assert diff[:2] == ["1", "0"], diff  # one row added, nothing else
