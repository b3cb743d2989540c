"""docs/extending.md's family recipe runs as written: its `bash recipe` block, in a scratch copy of
the repository, declares a new family (Mistral) from existing features in one new file of
model_specs/families/, and its last command (tools/gpu_check.py --cpu-smoke) makes a tiny Mistral
with transformers, converts it HF -> megatron -> HF bit-exactly, holds the actor's log-probs to
transformers' and takes a GSPO step, a checkpoint and an export. The copy's `git status`
afterwards: that one file, nothing else of the library.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_transport_recipe import COPIED, ROOT, recipe  # tests/sync/: the recipes' one reader

SECTION = "A model feature, and a family made of features"


@pytest.mark.slow
def test_the_family_recipe_runs_as_written(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, copy / name, ignore=ignore) if src.is_dir()
         else shutil.copy(src, copy / name))
    git = ["git", "-c", "user.name=recipe", "-c", "user.email=recipe@localhost"]
    subprocess.run(git + ["init", "-q"], cwd=copy, check=True)
    subprocess.run(git + ["add", "-A"], cwd=copy, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "before the recipe"], cwd=copy, check=True)
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    got = subprocess.run(["bash", "-e", "-c", recipe(SECTION)], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    print(got.stdout[-3000:])
    rows = [line for line in got.stdout.splitlines() if line.startswith("| ")]
    local = [r for r in rows if r.startswith("| local | fp32 |")]
    conversion = [r for r in rows if r.startswith("| HF -> megatron -> HF |")]
    assert local and local[0].endswith("| PASS |"), rows
    assert conversion and conversion[0].endswith("| PASS |"), rows
    assert "; mistral; specs checked: local" in got.stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--",
                              "gspo_errors", "gspo_megatron", "model_specs", "rollout", "tools"],
                             cwd=copy, capture_output=True, text=True, check=True).stdout.split("\n")
    assert [line for line in changed if line] == ["?? model_specs/families/mistral.py"], changed
