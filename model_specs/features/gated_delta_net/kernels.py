"""Whether the Gated DeltaNet's GPU kernels train correctly on this machine, decided at start.

On CUDA megatron-core runs the DeltaNet on flash-linear-attention's (fla) Triton kernels. On
Hopper (compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1 the gated backward kernel gives
wrong results (fla issue #640), and fla refuses it at the first backward (fla/ops/common/chunk_o.py
chunk_bwd_dqkwg, fla 0.5.2 to 0.6.0), unless its TileLang backend takes that kernel: tilelang
importable, an `nvcc` binary found the way fla looks for one (fla/utils/_compat.py
has_usable_nvcc), and FLA_TILELANG not "0" (fla/ops/common/backends/tilelang TileLangBackend).
torch 2.11 ships Triton 3.6.0: a run on an H100 or H200 reached that refusal after minutes of
set-up (docs/results.md, the H200 visit).

So a run refuses at start instead, in one line (run/preflight.py, and every Actor). Not a fallback:
the correct kernels left are the torch forms the CPU runs (layers.py use_torch_kernels), which
megatron-core selects only under deterministic_mode; on CUDA that mode also refuses TE's attention
unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and refuses packed sequences, and the chunked delta rule in
torch is an order of magnitude slower than fla's. A user can install what fla asks for in a minute;
a slow run that looks healthy costs GPU hours.

    line = backward_refusal(triton="3.6.0", capability=(9, 0), device="NVIDIA H200", tilelang=False)
    check_backward_kernels(...)   # DeltaRuleKernelError(line) where line is not None

Torch-free: the facts come from actor/settings.py's Available (detected, or a test's profile).
"""
from __future__ import annotations

import os
import re
import shutil
from importlib import metadata, util
from pathlib import Path

from gspo_errors import InputError

BROKEN_TRITON = ((3, 4, 0), (3, 7, 1))
"""Triton versions [low, high) with which fla's gated backward is wrong on Hopper (fla #640)."""


class DeltaRuleKernelError(InputError, RuntimeError):
    """The Gated DeltaNet cannot train correctly with the kernels of this machine (the message
    names the Triton version, the GPU and what to install)."""


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", (text or "").split("+")[0])[:3])


def backward_refusal(*, triton: str | None, capability: tuple[int, int] | None, device: str = "",
                     tilelang: bool = False) -> str | None:
    """The refusal's line, or None where fla's gated backward runs correctly: off Hopper, with
    Triton outside BROKEN_TRITON, or with fla's TileLang backend usable (`tilelang`)."""
    if capability is None or capability[0] != 9 or tilelang:
        return None
    low, high = BROKEN_TRITON
    if triton is None or not low <= _version(triton) < high:
        return None
    dotted = ".".join(map(str, high))
    return (f"Gated DeltaNet layers (Qwen3-Next) on {device or 'a Hopper GPU'} (compute capability "
            f"{capability[0]}.{capability[1]}) with Triton {triton}: flash-linear-attention's gated "
            f"backward gives wrong results with Triton >= {'.'.join(map(str, low))} and < {dotted} on "
            f"Hopper (fla issue #640) and refuses at the first backward; install triton>={dotted}, or "
            "tilelang with an nvcc on PATH or CUDA_HOME (fla's TileLang backend), then start again")


def check_backward_kernels(*, triton: str | None, capability: tuple[int, int] | None, device: str = "",
                           tilelang: bool = False) -> None:
    """DeltaRuleKernelError with backward_refusal's line, if there is one."""
    line = backward_refusal(triton=triton, capability=capability, device=device, tilelang=tilelang)
    if line is not None:
        raise DeltaRuleKernelError(line)


def triton_version() -> str | None:
    """The installed Triton's version (the name torch's wheels depend on, or PyTorch's own build)."""
    for name in ("triton", "pytorch-triton"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def tilelang_usable() -> bool:
    """fla would take its TileLang backend for the gated backward: tilelang importable, nvcc
    found where fla looks (CUDA_HOME / CUDA_PATH, PATH, the nvidia-cuda-nvcc wheel,
    /usr/local/cuda), and FLA_TILELANG not "0"."""
    if os.environ.get("FLA_TILELANG") == "0" or util.find_spec("tilelang") is None:
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists() or shutil.which("nvcc"):
        return True
    try:
        files = metadata.files("nvidia-cuda-nvcc") or []
    except metadata.PackageNotFoundError:
        files = []
    return any(f.name == "nvcc" for f in files) or (Path("/usr/local/cuda") / "bin" / "nvcc").exists()
