"""megatron-core without TorchDynamo and Inductor at import time, on machines without CUDA.

megatron-core decorates its fused kernels with `jit_fuser = torch.compile` when each module is
imported (megatron/core/jit.py: enable_jit_fuser; megatron/core/fusions/fused_bias_geglu.py and
its siblings: `@jit_fuser`). The first torch.compile call imports torch._dynamo and
torch._inductor: 2-4 s of CPU in every process that imports megatron-core (measured with
`python -X importtime -c "from gspo_megatron.actor import Actor"`: fused_bias_geglu 1.75 s
of megatron.core's 3.4 s). On CPU nothing calls those kernels (ComputeSettings refuses
bias_activation_fusion without CUDA; the rope and softmax fusions are TE's or off), so every
trainer rank, converter and test worker paid that for nothing.

`install()` puts a finder on sys.meta_path: while a `megatron.*` module executes, and only when
CUDA is absent, torch.compile is replaced by `deferred_compile`, which returns a function that
calls the real torch.compile on its first call and the compiled function from then on: what
torch.compile itself does (it compiles on the first call), without the import until then. With
CUDA nothing is replaced: the GPU path imports and compiles exactly as megatron-core does.

Importing this module costs nothing (no torch); torch is imported when megatron is.
"""
from __future__ import annotations

import functools
import inspect
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Callable

_lock = threading.RLock()
_depth = 0
_real: Callable | None = None


def deferred_compile(real: Callable) -> Callable:
    """torch.compile's signature; the real compile runs at the decorated function's first call."""
    def compile_later(model: Callable | None = None, **kwargs: Any) -> Callable:
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):  # a module (OptimizedModule) or anything else: as torch does
            return real(model, **kwargs)
        compiled: list[Callable] = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)
        return call
    return compile_later


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        global _depth, _real
        import torch
        if torch.cuda.is_available():
            return self._inner.exec_module(module)
        with _lock:
            if _depth == 0:
                _real = torch.compile
                torch.compile = deferred_compile(torch.compile)
            _depth += 1
        try:
            self._inner.exec_module(module)
        finally:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    torch.compile, _real = _real, None  # type: ignore[assignment]  # the real one, put back


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron" and not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; a no-op once megatron is imported (its modules are decorated already)."""
    if "megatron" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
