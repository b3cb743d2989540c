"""Push the trainer's weights into the SGLang servers after an optimizer step.

    sync = WeightSync(chunks, hf_config, transport=TensorTransport(pool), pool=pool)  # every rank
    report = sync.sync(version=step)     # collective; pool/transport are used on rank 0 only

One sync, on trainer rank 0: pause generation on every server (running requests are retracted and
re-run with the new weights), stream the weights (stream.py) through the transport, set the new
weight version with the last piece, check that every server reports it, continue generation.
The other ranks only take part in the stream. If anything fails part-way, the servers are LEFT
PAUSED (they may hold a mix of old and new weights, so they must not generate), `stale` is set,
and every rank raises WeightSyncError; a later successful sync (all weights are sent each time)
un-pauses them.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.sync.stream import build_plan, buckets, stream_hf_weights
from gspo_megatron.sync.transports import Transport
from model_specs.weight_maps import weight_map_for


def _unreachable(error: BaseException | None) -> bool:
    """A lost connection anywhere in the error's chain (rollout.client.ServerUnavailable, or the
    transport's own ConnectionError)."""
    from rollout.client import ServerUnavailable
    while error is not None:
        if isinstance(error, (ServerUnavailable, ConnectionError)):
            return True
        error = error.__cause__ or error.__context__
    return False


class WeightSyncError(RuntimeError):
    """A sync that did not complete; the servers are paused and marked stale."""


class WeightSync:
    """Weight sync of one trainer job (construct on every rank; `transport` and `pool` are only
    used on global rank 0 and may be None elsewhere)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hf_config: Mapping[str, Any],
                 transport: Transport | None, pool=None, *, bucket_bytes: int = 256 << 20,
                 pause_mode: str = "retract") -> None:
        self.chunks = list(chunks)
        self.wmap = weight_map_for(hf_config)
        self.transport, self.pool = transport, pool
        self.bucket_bytes, self.pause_mode = bucket_bytes, pause_mode
        self.rank = dist.get_rank()
        if self.rank == 0 and (transport is None or pool is None):
            raise ValueError("WeightSync on rank 0 needs a transport and the server pool")
        self._plan = None
        self.version: str | None = None  # the version the servers serve, as far as we know
        self.stale = False               # True after a failed sync: servers paused, weights mixed

    def sync(self, version: str | int) -> dict[str, float]:
        """Collective. Returns {seconds, bytes, gb_per_s, buckets} (rank 0's view on rank 0)."""
        version = str(version)
        if version == self.version:
            raise ValueError(f"weight version {version!r} is what the servers already serve; "
                             "every sync needs a new version")
        if self._plan is None:
            self._plan = build_plan(self.chunks, self.wmap)
        n_buckets = len(buckets(self._plan, self.bucket_bytes))
        start, sent, error = time.perf_counter(), 0, None
        if self.rank == 0:
            error = self._try(lambda: (self.pool.pause_generation(self.pause_mode),
                                       self.transport.begin(version)))
        for i, bucket in enumerate(stream_hf_weights(self.chunks, self.wmap, self._plan,
                                                     self.bucket_bytes)):
            # Failed on rank 0: keep walking the stream so the other ranks' collectives finish.
            if self.rank == 0 and error is None:
                error = self._try(lambda: self.transport.send(bucket, i == n_buckets - 1, version))
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
        if self.rank == 0 and error is None:
            error = self._try(lambda: self._finish(version))
        message = [f"{type(error).__name__}: {error}" if error is not None else None,
                   _unreachable(error)]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None:
            self.stale = True
            after = ("A server could not be reached (did it die?): restart it, then sync again; "
                     "servers still up are paused" if message[1] else
                     "The servers are left paused") + " and may hold a mix of old and new weights; " \
                "sync again before generating."
            raise WeightSyncError(f"weight sync to version {version} via "
                                  f"{getattr(self.transport, 'name', '?')} failed: {message[0]}. {after}")
        self.stale, self.version = False, version
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": float(sent), "buckets": float(n_buckets),
                "gb_per_s": sent / seconds / 1e9 if seconds > 0 else 0.0}

    def _finish(self, version: str) -> None:
        self.transport.finish(version)
        served = self.pool.weight_versions()
        wrong = {c.url: v for c, v in zip(self.pool.live_clients(), served) if v != version}
        if wrong:
            raise WeightSyncError(f"servers report weight versions {wrong} after the update, "
                                  f"expected {version!r}")
        self.pool.continue_generation()

    @staticmethod
    def _try(fn) -> BaseException | None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank by sync()
            return e
        return None
