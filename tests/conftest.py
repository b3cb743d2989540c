import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# Tests import the project from the repository (editable install) and the helpers beside them.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(TESTS))
# Test modules mirror the packages (tests/actor/test_batch.py, ...) and have unique names; a few
# share helpers across folders (`from test_actor_layouts import _np`), and spawned ranks import the
# module of the function they run by its name. Every test folder is on the path, after the project,
# so that a folder named like a package (tests/rollout) never hides it.
sys.path += [str(d) for d in sorted(TESTS.rglob("*")) if d.is_dir() and d.name not in ("__pycache__", "data")
             and not d.name.startswith(".")]
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# Plug-in modules (docs/extending.md) imported before the tests are collected: the tests that run
# over every row of a table (LOSSES, ESTIMATORS, KL_ESTIMATORS, ...) then run over theirs too.
from gspo_tables import import_plugins  # noqa: E402

import_plugins([m for m in os.environ.get("GSPO_PLUGINS", "").split(",") if m], "GSPO_PLUGINS")

# Session-scoped real SGLang servers shared by every rollout test module (one instance each).
from fixtures_servers import moe_server, qwen3_server  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Files with the most slow tests (servers, rank groups: 30-110 s each) run first, each file's
    tests in their own order. scripts/test.sh hands whole files to two workers in this order
    (`--dist loadfile --no-loadscope-reorder`): xdist's default order, most tests first, put the
    files of one or two 100 s tests last, where one worker ran them alone while the other idled.
    The sort is stable: files with as many slow tests, and each file's tests, keep their order."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
