"""Weight sync into SGLang: the live model's parameters as HF-named full tensors, in size-bounded
buckets (stream.py), through one of the transports of the TRANSPORTS table (transports.py), with
pause / version check / stale-on-failure handling (weight_sync.py).

    transport = make_transport("tensor", pool, hf_path=..., sync_dir=..., master_address=...)
    sync = WeightSync(actor.chunks, hf_config, transport, pool)
    sync.sync(version=step)

May import: actor (full weights), checkpoint (HF files), parallel, model_specs (weight maps),
rollout (the server pool); never config, run, driver, trainer or cli.
"""
from gspo_megatron.sync.stream import build_plan, stream_hf_weights
from gspo_megatron.sync.transports import (TRANSPORTS, DiskTransport, DistributedTransport, TensorTransport,
                                           make_transport)
from gspo_megatron.sync.weight_sync import WeightSync, WeightSyncError

__all__ = ["TRANSPORTS", "DiskTransport", "DistributedTransport", "TensorTransport", "WeightSync",
           "WeightSyncError", "build_plan", "make_transport", "stream_hf_weights"]
