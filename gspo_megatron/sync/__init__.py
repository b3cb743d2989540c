"""Weight sync into SGLang: every sender streams its own HF-named tensors (stream.py), whole or as
deltas (delta.py), in one pass per attempt (sender_pass.py) that rank 0 coordinates, with pause /
version check / stale-on-failure handling (weight_sync.py); how the parts reach the servers is a
transport (transport_base.py), a row of the one table TRANSPORTS (transports.py: disk.py, tensor.py,
distributed.py).

    transport = make_transport("tensor", pool, hf_path=..., sync_dir=..., master_address=...)
    sync = WeightSync(actor.chunks, hf_config, transport, pool)
    sync.sync(version=step)

Names are imported on first use (PEP 562), so that reading the table (the run config, the start
checks) does not import torch.

May import: actor (full weights), checkpoint (HF files), parallel, model_specs (weight maps),
rollout (the server pool); never config, run, driver, trainer or cli.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TRANSPORTS": "transports", "Transport": "transport_base", "Sender": "transport_base",
    "make_transport": "transport_base", "DiskTransport": "disk", "TensorTransport": "tensor",
    "DistributedTransport": "distributed", "WeightSync": "weight_sync", "WeightSyncError": "weight_sync",
    "build_plan": "stream", "stream_hf_weights": "stream", "hf_state_dict": "stream",
}
__all__ = sorted(_EXPORTS)


if TYPE_CHECKING:  # the names as the checker sees them; at run time __getattr__ imports them
    from gspo_megatron.sync.disk import DiskTransport
    from gspo_megatron.sync.distributed import DistributedTransport
    from gspo_megatron.sync.stream import build_plan, hf_state_dict, stream_hf_weights
    from gspo_megatron.sync.tensor import TensorTransport
    from gspo_megatron.sync.transport_base import Sender, Transport, make_transport
    from gspo_megatron.sync.transports import TRANSPORTS
    from gspo_megatron.sync.weight_sync import WeightSync, WeightSyncError
else:
    def __getattr__(name: str) -> Any:
        if name in _EXPORTS:
            return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


