"""tools/resolve_imports.py: every import of our own packages in the packages, tools, benchmarks,
launch and scripts resolves, function-level imports included, so a module that a move renamed fails
CI instead of a GPU visit; and planted bad imports of each kind are named with their file and line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "resolve_imports.py"


def resolve(*args: str, path: str = "") -> subprocess.CompletedProcess:
    # a process of its own: the check imports every module of the project once
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(ROOT)]))}
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_every_import_of_our_packages_resolves():
    out = resolve()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^0 unresolved imports of own packages in \d+ files$", out.stdout, re.M), out.stdout
    # what this machine cannot import is resolved from its source, and said
    for line in out.stdout.splitlines():
        if line.startswith("resolved from its source"):
            warnings.warn(line)


def test_planted_bad_imports_are_named(tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "gpu_only.py").write_text(
        "from typing import TYPE_CHECKING\nimport no_such_cuda_extension_xyz\n\n\ndef kernel():\n    pass\n\n\n"
        "if TYPE_CHECKING:\n    Alias = int\n")
    (pkg / "broken.py").write_text("from gspo_errors import NoSuchError\n")
    (pkg / "raises.py").write_text("LIMIT = undefined_name + 1\n")  # our own bug, not a missing package
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    Model = int\n")
    tool = pkg / "tool.py"
    tool.write_text("""from typing import TYPE_CHECKING

from gspo_errors import GspoError
from .gpu_only import kernel

if TYPE_CHECKING:
    from .typed import Model


def on_the_gpu():
    from gspo_megatron.actor import packing
    from gspo_megatron.actor.batching import packing as moved
    from .gpu_only import nothing_here
    import rollout.no_such_module
    from .broken import x
    from .typed import Model as at_run_time
    from .raises import LIMIT
""")
    out = resolve(str(tool), "--own", "probe_pkg", path=str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    problems = [line for line in out.stdout.splitlines() if line.startswith(str(tool))]
    assert [p.split(": ", 2)[0].rsplit(":", 1)[1] for p in problems] == ["11", "13", "14", "15", "16", "17"], problems
    assert problems[0].endswith("from gspo_megatron.actor import packing: gspo_megatron.actor has no 'packing'")
    assert problems[1].endswith("from probe_pkg.gpu_only import nothing_here: probe_pkg.gpu_only has no "
                                "'nothing_here'")
    assert "import rollout.no_such_module: ModuleNotFoundError" in problems[2]
    assert "from probe_pkg.broken import x: ImportError: cannot import name 'NoSuchError'" in problems[3]
    assert problems[4].endswith("probe_pkg.typed has no 'Model'")  # defined for the checker only
    assert problems[5].endswith("from probe_pkg.raises import LIMIT: NameError: name 'undefined_name' is not defined")
    assert ("resolved from its source, not importable here (ModuleNotFoundError: No module named "
            "'no_such_cuda_extension_xyz'): probe_pkg.gpu_only") in out.stdout
    assert "6 unresolved imports of own packages in 1 files" in out.stdout

    # --follow reaches the modules a file imports, and their function-level imports
    entry = tmp_path / "entry.py"
    entry.write_text("def main():\n    from probe_pkg import tool\n")
    followed = resolve(str(entry), "--own", "probe_pkg", "--follow", path=str(tmp_path))
    assert followed.returncode == 1 and f"{tool}:11: from gspo_megatron.actor import packing" in followed.stdout
    assert resolve(str(entry), "--own", "probe_pkg", path=str(tmp_path)).returncode == 0
