"""The project's patches for every SGLang server that returns routed experts, GPU or CPU.

Python imports `sitecustomize` at start-up from PYTHONPATH: rollout.servers.launch puts this
directory first on the PYTHONPATH of a server started with --enable-return-routed-experts, and
SGLang's scheduler and detokenizer processes inherit it (spawned on a GPU, which imports this again;
forked on a CPU, which inherits the patched modules). Here:
- rollout/in_server/released_routes.py, patched into SGLang's modules when they are imported:
  the routes of a request whose KV is released (a retract) are kept for its response;
- then the next `sitecustomize` on the path runs, which this one would otherwise hide: the CPU
  stand-ins' (rollout/in_server/cpu_stand_ins/sitecustomize.py) on a CPU server, or the
  environment's own.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from rollout.in_server.released_routes import PATCHES


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name](module) right after the module `name` is first imported."""

    def __init__(self, patches):
        self.pending = dict(patches)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        patch = self.pending.pop(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module)
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # the patch, on purpose: this loader only
        return spec


def _run_next_sitecustomize():
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


sys.meta_path.insert(0, _PatchOnImport({n: p for n, p in PATCHES.items() if n not in sys.modules}))
for _name, _patch in PATCHES.items():
    if _name in sys.modules:  # imported before site ran (not by SGLang's own start-up)
        _patch(sys.modules[_name])
_run_next_sitecustomize()
