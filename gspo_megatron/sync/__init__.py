"""Weight sync into SGLang: the live model's parameters as HF-named full tensors, in size-bounded
buckets (stream.py), through one of three transports (transports.py), with pause / version check /
stale-on-failure handling (weight_sync.py).

    sync = WeightSync(actor.chunks, hf_config, TensorTransport(pool), pool)
    sync.sync(version=step)
"""
from gspo_megatron.sync.stream import build_plan, stream_hf_weights
from gspo_megatron.sync.transports import DiskTransport, DistributedTransport, TensorTransport
from gspo_megatron.sync.weight_sync import WeightSync, WeightSyncError

__all__ = ["DiskTransport", "DistributedTransport", "TensorTransport", "WeightSync",
           "WeightSyncError", "build_plan", "stream_hf_weights"]
