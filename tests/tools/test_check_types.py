"""The type checker catches what the tests of a CPU machine cannot reach: a lazy import, inside a
function of tools/ that only a GPU runs, of a module a move renamed (`gspo_megatron.actor.packing`
became `gspo_megatron.actor.batching.packing`, and only a GPU visit found it). The function is
unannotated on purpose: mypy's default leaves such bodies unchecked, pyproject.toml's
check_untyped_defs for the project's packages is what finds it.

mypy runs with the project's configuration and cache (.mypy_cache, warm once scripts/lint.sh
ran: scripts/test.sh runs it first), on a scratch copy of tools/ that stands first on its path."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "\n\ndef _planted():\n    from gspo_megatron.actor import packing\n    return packing.PackedInputs\n"


def _mypy_on_a_copy_of_tools(tmp_path: Path, plant: bool) -> subprocess.CompletedProcess:
    shutil.copytree(ROOT / "tools", tmp_path / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "tools" / "make_counting_task.py"
    if plant:
        target.write_text(target.read_text() + PLANTED)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}  # the copy is `tools`, ahead of the repository's
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(target)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_lazy_import_of_a_renamed_module_in_tools_is_a_finding(tmp_path):
    out = _mypy_on_a_copy_of_tools(tmp_path, plant=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'make_counting_task.py:' in out.stdout and 'Module "gspo_megatron.actor" has no attribute "packing"' \
        in out.stdout, out.stdout


def test_the_same_copy_without_the_plant_is_clean(tmp_path):
    out = _mypy_on_a_copy_of_tools(tmp_path, plant=False)
    assert out.returncode == 0 and "Success: no issues found" in out.stdout, out.stdout + out.stderr
