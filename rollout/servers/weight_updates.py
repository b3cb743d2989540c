"""The weight-update calls of the SGLang HTTP client (rollout/servers/client.py): disk, tensor (shared
memory) and distributed (a process group with the trainer), the session around them, and the
serialisation SGLang expects. A mixin of SGLangClient: `client.update_weights_from_disk(...)`.
"""
from __future__ import annotations

import base64
import io
from typing import Any, Sequence


class WeightUpdates:
    """SGLangClient's weight-update endpoints (it supplies `_checked`)."""

    def _checked(self, path: str, payload: Any, **kw: Any) -> dict:
        """POST `payload` to `path` and check SGLang's success flag (SGLangClient's)."""
        raise NotImplementedError

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 load_format: str | None = None, timeout_s: float = 600.0) -> dict:
        """Reload all weights from an HF directory (safetensors + config) readable by the server.

        weight_version: the label generated tokens carry from now on (GenerateOutput.weight_versions).
        """
        payload = _drop_none(model_path=str(model_path), flush_cache=flush_cache,
                             abort_all_requests=abort_all_requests, weight_version=weight_version,
                             load_format=load_format)
        return self._checked("/update_weights_from_disk", payload, timeout_s=timeout_s, retry="connect")

    def begin_weight_update(self) -> dict:
        """Open a weight-update session; required around update_weights_from_tensor/_distributed."""
        return self._checked("/begin_weight_update", {}, timeout_s=120, retry="connect")

    def end_weight_update(self) -> dict:
        return self._checked("/end_weight_update", {}, timeout_s=120, retry="connect")

    def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, Any]],
                                   weight_version: str | None = None, *, flush_cache: bool = True,
                                   tp_size: int = 1, load_format: str | None = None,
                                   timeout_s: float = 600.0) -> dict:
        """Send (HF name, tensor) pairs by shared memory: the server must run on this machine.

        Call between begin_weight_update() and end_weight_update(). Host tensors go through
        torch.multiprocessing's "file_system" sharing strategy (the default strategy crashes the
        server, docs/cpu.md), CUDA tensors as CUDA IPC handles (a server on the same GPU maps them:
        serialize_named_tensors); keep them alive until this returns. `tp_size`: the server's TP size
        (each TP rank receives the same list). A partial list updates only those parameters.
        """
        payload = _drop_none(serialized_named_tensors=[serialize_named_tensors(named_tensors)] * tp_size,
                             flush_cache=flush_cache, weight_version=weight_version,
                             load_format=load_format)
        return self._checked("/update_weights_from_tensor", payload, timeout_s=timeout_s, retry="connect")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 300.0) -> dict:
        """Make the server's ranks join a process group with the trainer (trainer = rank 0).

        BLOCKS until every rank has joined, so call it from a thread (ServerPool.submit) while the
        trainer builds its side: a PrefixStore named `group_name` over a TCPStore at
        master_address:master_port, world_size = 1 + sum of servers' TP sizes; this server's ranks
        start at rank_offset. backend "gloo" on CPU, "nccl" on GPU.
        """
        payload = {"master_address": master_address, "master_port": int(master_port),
                   "rank_offset": int(rank_offset), "world_size": int(world_size),
                   "group_name": group_name, "backend": backend}
        return self._checked("/init_weights_update_group", payload, timeout_s=timeout_s, retry="connect")

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None, *, flush_cache: bool = True,
                                        load_format: str | None = None, timeout_s: float = 600.0) -> dict:
        """Receive tensors by broadcast from rank 0 of the weights-update group.

        BLOCKS until the trainer has broadcast every tensor, in this order, so call it from a
        thread. dtypes are torch names without "torch." ("float32", "bfloat16"). Must be inside
        begin/end_weight_update; check that begin succeeded BEFORE broadcasting, or the trainer
        hangs in broadcast until the collective's timeout. load_format "flattened_bucket": one
        broadcast of the tensors' bytes concatenated in this order, each at an offset that is a
        multiple of its element size (SGLang's weight_sync/tensor_bucket.py FlattenedTensorBucket).
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}, {len(dtypes)}, {len(shapes)}")
        payload = _drop_none(names=list(names), dtypes=[str(d).replace("torch.", "") for d in dtypes],
                             shapes=[list(map(int, s)) for s in shapes], group_name=group_name,
                             flush_cache=flush_cache, weight_version=weight_version,
                             load_format=load_format)
        return self._checked("/update_weights_from_distributed", payload, timeout_s=timeout_s,
                             retry="connect")

    def served_tensors(self, shapes: dict[str, Sequence[int]], path: str) -> dict[str, Any]:
        """The values the server holds of these HF tensors (name -> shape), read back in HF layout
        by the project's loader (rollout/in_server/weight_loader.py) into a safetensors file at `path` (on
        this machine: the server writes it) and returned. For checks: it probes every tensor."""
        import torch
        from safetensors.torch import load_file

        from rollout.in_server.weight_loader import LOADER, PART, path_tensor
        payload = [(n + PART + "shape", torch.tensor([int(x) for x in s])) for n, s in shapes.items()]
        self.begin_weight_update()
        try:
            self.update_weights_from_tensor(payload + [(PART + "export", path_tensor(path))],
                                            load_format=LOADER, flush_cache=False)
        finally:
            self.end_weight_update()
        return load_file(path)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name},
                             timeout_s=60, retry="connect")


def _drop_none(**fields: Any) -> dict[str, Any]:
    """A request body without the optional fields left at None (SGLang then uses its defaults);
    weight_version goes as a string (SGLang's label type)."""
    body = {k: v for k, v in fields.items() if v is not None}
    if "weight_version" in body:
        body["weight_version"] = str(body["weight_version"])
    return body


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """Pickle (name, tensor) pairs the way SGLang's MultiprocessingSerializer does (ForkingPickler),
    base64-encoded for JSON. A tensor travels where it is: a host tensor by shared memory (torch's
    "file_system" sharing strategy), a CUDA tensor as a CUDA IPC handle to its memory, which a
    process on the same GPU (a colocated server) maps without a copy. The tensors must stay alive
    until the server has applied them (the call returns)."""
    return serialize([(str(n), t.detach().contiguous()) for n, t in named_tensors])


def serialize(value: Any) -> str:
    """`value` (tensors inside: by shared memory, or CUDA IPC) as SGLang's MultiprocessingSerializer
    pickles it, base64-encoded for JSON."""
    import torch.multiprocessing as torch_mp
    from multiprocessing.reduction import ForkingPickler

    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(value)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, Any]]:
    """What a server makes of one rank's serialize_named_tensors() (SGLang's
    MultiprocessingSerializer.deserialize: base64, then unpickling, which maps shared memory and
    opens CUDA IPC handles): for a process that stands in for a server (tools/gpu_check_sync.py)."""
    import pickle

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions (shared memory, CUDA IPC)

    return pickle.loads(base64.b64decode(data))
