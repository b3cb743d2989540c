"""Patches applied to an SGLang module right after its first import, for the `sitecustomize` files
that run at a server's start-up (startup/ on every server that returns routes, cpu_stand_ins/ on a
CPU server). Standard library only: it runs before anything else of the server.

    install({"sglang.srt.managers.schedule_batch": patch})   # patch(module) once it is imported
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Callable, Mapping

Patch = Callable[[types.ModuleType], None]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patches[name](module) right after the module `name` is first imported; leaves
    sys.meta_path once every patch ran."""

    def __init__(self, patches: Mapping[str, Patch]) -> None:
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


def install(patches: Mapping[str, Patch]) -> None:
    """Each patch on its module: at once where it is imported already (before site ran, not by
    SGLang's own start-up), else right after its first import."""
    later = {name: patch for name, patch in patches.items() if name not in sys.modules}
    if later:
        sys.meta_path.insert(0, PatchOnImport(later))
    for name, patch in patches.items():
        if name not in later:
            patch(sys.modules[name])
