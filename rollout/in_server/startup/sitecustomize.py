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
import importlib.machinery
import importlib.util
import os
import sys

from rollout.in_server.patch_on_import import install
from rollout.in_server.released_routes import PATCHES


def _run_next_sitecustomize():
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


install(PATCHES)
_run_next_sitecustomize()
