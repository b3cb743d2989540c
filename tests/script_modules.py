"""Import a script of benchmarks/ or launch/ by its path, without putting its folder on sys.path.

A folder at the front of sys.path shadows the project's packages for the rest of the session,
spawned ranks included (they inherit sys.path): benchmarks/rollout.py once hid the rollout
package from tests/sync/test_weight_sync_families.py's ranks ("'rollout' is not a package")."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    path = ROOT / relative
    name = "_script_" + relative.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
