"""Where communication tensors live: the device of the process group's backend.

    dev = comm_device(group)                       # cuda:<current> for NCCL, cpu for gloo
    n = torch.tensor([count], device=comm_device(group)); dist.all_reduce(n, group=group)

NCCL only moves CUDA tensors ("No backend type associated with device type cpu"), gloo only CPU
ones, so every tensor the project hands to a collective is created on, or moved to, the device
this module names. Object collectives (broadcast_object_list, all_gather_object, ...) choose their
device themselves and are exempt.

A CPU test cannot see the NCCL rule, so `strict_checks()` imitates it on gloo: while it is on,
tensors that project code creates on the default device (a factory call such as torch.tensor(...)
without `device=`, or `.cpu()`) are marked as host tensors, and a collective called from project
code with a host tensor raises, as NCCL would. Tensors created with an explicit device, moved with
.to(device), or derived from model parameters and activations are not marked: on a GPU they live
where NCCL wants them. tests/parallel/test_comm.py runs the actor, the sync stream and the
checkpoint code under it.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from types import FrameType
from typing import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_PROJECT_PREFIXES = ("gspo_megatron.", "rollout.")
_TRANSPARENT = ("gspo_megatron.parallel.comm", "gspo_megatron.parallel.cpu_compat")


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on for a collective over `group` (None: the default group)."""
    backend = str(dist.get_backend(group)) if dist.is_initialized() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_comm(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`t` on the collective's device (a no-op when it is there already)."""
    return t.to(comm_device(group))


# --- strict mode (tests) -------------------------------------------------------------------------
class HostTensor(torch.Tensor):
    """A tensor project code made on the default device (strict mode only); `origin` says where.
    It pickles (torch.save, object collectives) as a plain tensor: the mark never reaches a file."""

    origin: str = "?"

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


_FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.as_tensor, torch.randn, torch.rand, torch.zeros_like, torch.ones_like,
              torch.empty_like, torch.full_like}
# isend / irecv stay unwrapped: torch's P2POp checks them by identity (distributed_c10d._check_op).
# The project's one isend (actor/batching/transfer.py) sends buffers moved with .to(comm_device()); strict
# mode cannot check it, the matching recv it does.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
                "reduce", "gather", "scatter")


def _project_caller(depth: int) -> str | None:
    """'module:line' of the calling frame `depth` up if it is project code, else None. Frames of
    the torch-function modes themselves (this module, cpu_compat's CpuDeviceMode, which may sit
    above this one) are looked through."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_TRANSPARENT):
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    if name.startswith(_PROJECT_PREFIXES):
        return f"{name}:{frame.f_lineno}"
    return None


class _HostTensorMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # a HostTensor argument makes a HostTensor result (subclass rules)
        if func in _FACTORIES and "device" not in kwargs and (
                not func.__name__.endswith("_like") or isinstance(args[0], HostTensor)):
            origin = _project_caller(2)
            return _mark(out, origin) if origin else out
        if func is torch.Tensor.cpu:
            origin = _project_caller(2)
            return _mark(out, origin) if origin else _unmark(out)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return _unmark(out)  # an explicit move: the caller decided the device
        if isinstance(out, HostTensor):
            out.origin = next((a.origin for a in _flat(args, kwargs) if isinstance(a, HostTensor)), "?")
        return out


def _flat(args, kwargs) -> Iterator:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _mark(out, origin: str):
    if isinstance(out, torch.Tensor) and out.device.type == "cpu":
        out = out.as_subclass(HostTensor)
        out.origin = origin
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_mark(o, origin) for o in out)
    return _unmark(out)


def _unmark(out):
    if isinstance(out, HostTensor):
        return out.as_subclass(torch.Tensor)
    if isinstance(out, (list, tuple)) and any(isinstance(o, HostTensor) for o in out):
        return type(out)(_unmark(o) for o in out)
    return out


def _checked(name: str, fn):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        caller = _project_caller(2)
        if caller is not None:
            for a in _flat(args, kwargs):
                if isinstance(a, HostTensor):
                    raise RuntimeError(
                        f"{name} at {caller} got a host tensor (made at {a.origin}): NCCL would "
                        "fail with 'No backend type associated with device type cpu'; create it "
                        "with device=comm_device(group) or move it with to_comm()")
        return fn(*args, **kwargs)
    return collective


@contextlib.contextmanager
def strict_checks() -> Iterator[None]:
    """Imitate NCCL's device rule on gloo for project code (see the module docstring)."""
    originals = {n: getattr(dist, n) for n in _COLLECTIVES}
    for n, fn in originals.items():
        setattr(dist, n, _checked(n, fn))
    mode = _HostTensorMode()
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        for n, fn in originals.items():
            setattr(dist, n, fn)
