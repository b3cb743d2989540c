"""Stand-in `sgl_kernel` for SGLang on CPU hosts without a CPU kernel build (see ../__init__.py).

`import sgl_kernel` and `from sgl_kernel import any_op` succeed; calling any op raises
NotImplementedError(op name). Submodules (`sgl_kernel.flash_attn`, ...) deliberately do not exist:
SGLang guards some of those imports with `except ImportError` and must keep taking its fallbacks.
The one exception is `sgl_kernel.mamba` (mamba.py), which SGLang imports only on CPU, for
Qwen3-Next's Gated DeltaNet: torch implementations from ../gdn_ops.py.
"""
from __future__ import annotations

import sys
import types

__version__ = "0.0.0+cpu-stand-in"


def _stub(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: a CUDA/AMX kernel was called, but this is gspo-megatron's CPU "
            "stand-in for sgl_kernel (rollout/cpu_stand_ins): SGLang left its torch-native path.")
    op.__name__ = op.__qualname__ = name
    return op


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(name)


sys.modules[__name__].__class__ = _StandInModule
