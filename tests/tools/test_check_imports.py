"""The house's rules (tools/check_imports.py): the error base (gspo_errors) is the bottom, nothing
imports gspo_megatron's root, model_specs and rollout import nothing of gspo_megatron, algorithms
are pure torch, the library packages know nothing of
the run, the config and the first checks load without torch, only the entry points sit at
gspo_megatron's top, no two modules have near-twin names, and no module imports itself through
others, and no package through other packages; no two modules import each other, not even under
TYPE_CHECKING; no package holds more than 12 modules at its top.
Also: no source file over 400 lines (STYLE: split by concern), and no citation of code by line
number (STYLE: by function and version)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tools import check_imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_tree_follows_the_rules():
    assert check_imports.violations() == []


@pytest.mark.parametrize("where,line,needle", [
    ("model_specs/families/__init__.py", "from gspo_megatron.parallel.layout import ParallelLayout",
     "model_specs.families imports gspo_megatron.parallel.layout (model_specs knows HF and megatron-core"),
    ("model_specs/hf/config.py", "from gspo_megatron import GspoError",
     "model_specs.hf.config imports gspo_megatron (model_specs knows HF"),
    ("rollout/servers/errors.py", "from gspo_megatron import GspoError",
     "rollout.servers.errors imports gspo_megatron's root"),
    ("gspo_megatron/sync/delta.py", "from gspo_megatron import GspoError",
     "gspo_megatron.sync.delta imports gspo_megatron's root"),
    ("gspo_errors/__init__.py", "from rollout.servers import errors",
     "gspo_errors imports rollout.servers.errors (the error base is the bottom"),
    ("rollout/servers/ports.py", "def f():\n    from rollout.generation import sample",
     "package cycle: rollout.generation <-> rollout.servers"),
    ("rollout/servers/m13.py", "X = 1", "rollout/servers/ holds 13 modules at its top (at most 12"),
    ("rollout/generation/sample.py", "from gspo_megatron.actor.batching.batch import TrainBatch",
     "rollout.generation.sample imports gspo_megatron.actor.batching.batch (rollout knows nothing of megatron"),
    ("gspo_megatron/actor/batching/balance.py", "from gspo_megatron.config import RunConfig",
     "gspo_megatron.actor.batching.balance imports gspo_megatron.config (the library packages know nothing of the run)"),
    ("gspo_megatron/driver/staleness.py", "from gspo_megatron.run.folders import scratch_dir",
     "gspo_megatron.driver.staleness imports gspo_megatron.run.folders (run/ builds the driver)"),
    ("gspo_megatron/run/setup.py", "from gspo_megatron.trainer import run_loop",
     "gspo_megatron.run.setup imports gspo_megatron.trainer (only the command line runs the loop)"),
    ("gspo_megatron/run/folders.py", "import torch",
     "gspo_megatron.run.folders imports torch, and gspo_megatron.run.preflight imports"),
    ("gspo_megatron/helpers.py", "X = 1",
     "gspo_megatron.helpers sits at gspo_megatron's top"),
    ("gspo_megatron/actor/microbatches.py", "X = 1",
     "near-twin module names: gspo_megatron.actor.batching.micro_batch, gspo_megatron.actor.microbatches"),
    ("rollout/generation/sample.py", "import megatron.core", "rollout.generation.sample imports megatron"),
    ("gspo_megatron/algorithms/rows.py", "from megatron.core import parallel_state",
     "gspo_megatron.algorithms.rows imports megatron"),
    ("gspo_megatron/parallel/layout.py", "import torch",
     "gspo_megatron.parallel.layout imports torch, and gspo_megatron.config imports"),
    ("gspo_megatron/checkpoint/hf_files.py", "def f():\n    from gspo_megatron.checkpoint import manager",
     "import cycle: gspo_megatron.checkpoint.hf_files <-> gspo_megatron.checkpoint.manager"),
    ("gspo_megatron/checkpoint/hf_files.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gspo_megatron.checkpoint import manager",
     "modules that import each other: gspo_megatron.checkpoint.hf_files <-> gspo_megatron.checkpoint.manager"),
    ("rollout/generation/sample.py", "if TYPE_CHECKING:\n    from gspo_megatron.config import RunConfig",
     "rollout.generation.sample imports gspo_megatron.config (rollout knows nothing of megatron"),
])
def test_the_checker_catches_each_kind_of_violation(tmp_path, monkeypatch, where, line, needle):
    for pkg in check_imports.PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for i in range(11, 13):  # rollout/servers/ holds 10 modules: two more make it 12, the rule's edge
        if where.endswith("m13.py"):
            (tmp_path / f"rollout/servers/m{i}.py").write_text("X = 1\n")
    planted = tmp_path / where
    planted.write_text((planted.read_text() if planted.exists() else "") + "\n" + line + "\n")
    monkeypatch.setattr(check_imports, "ROOT", tmp_path)
    found = check_imports.violations()
    assert any(needle in v for v in found), found


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in ("gspo_megatron", "model_specs", "rollout", "tools",
                                                    "benchmarks", "launch", "tests", "scripts")
            for p in (ROOT / pkg).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


# `name.py:NNN`: a line number moves between the megatron-core versions we support (0.16 to 0.19)
# and with every SGLang or our own edit; cite the function (and the version where it matters).
LINE_CITATION = re.compile(r"[\w/.-]+\.py:\d+")
# docs/results.md is a dated log of measurements: a line number beside its commit is history there.
LINE_CITATIONS_ALLOWED = {"docs/results.md"}


def test_no_file_cites_code_by_line_number():
    a, b = "megatron/core/transformer/moe/moe_utils.py", "router.py"  # apart, so this file cites none
    assert LINE_CITATION.findall(f"({a}:700-706, {b}:56)") == [f"{a}:700", f"{b}:56"]
    files = [*ROOT.glob("*.md"), *(p for top in ("gspo_errors", "gspo_megatron", "model_specs", "rollout",
                                                 "tools", "benchmarks", "tests", "docs", "scripts", "launch",
                                                 "examples", ".ci")
                                   for ext in ("py", "md", "sh") for p in (ROOT / top).rglob(f"*.{ext}"))]
    cited = [f"{rel}:{n}: {m}" for p in files if (rel := str(p.relative_to(ROOT))) not in LINE_CITATIONS_ALLOWED
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in LINE_CITATION.findall(line)]
    assert len(files) > 300 and cited == []


def test_a_type_checking_import_closes_no_cycle(tmp_path, monkeypatch):
    """STYLE's way to name the type of a module further up an import chain: the import never runs,
    so it is no cycle (and still counts for the direction rules, above); only between two modules
    that import each other is it refused (the parametrized case above)."""
    for pkg in check_imports.PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    # convert -> manager -> loop_state, and loop_state names convert's types
    loop_state = tmp_path / "gspo_megatron/checkpoint/loop_state.py"
    typed = "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gspo_megatron.checkpoint import convert\n"
    loop_state.write_text(loop_state.read_text() + typed)
    monkeypatch.setattr(check_imports, "ROOT", tmp_path)
    assert check_imports.violations() == []
    loop_state.write_text(loop_state.read_text() + "from gspo_megatron.checkpoint import convert\n")
    assert any(v.startswith("import cycle: ") and "gspo_megatron.checkpoint.loop_state" in v
               and "gspo_megatron.checkpoint.convert" in v for v in check_imports.violations())
