"""The weight sync of a LoRA run: the adapters only, never the base.

    sync = AdapterSync(chunks, hf_config, pool, lora_settings, name="gspo")   # every rank
    report = sync.sync(version=step)                                          # collective

The base never changes, so the servers keep the base they started with (model.hf_path) and receive
each step's adapters: for Qwen3-30B-A3B at rank 32 about 1 GB in bf16 instead of the model's 61 GB
(`gspo-megatron plan`). One adapter name serves the whole run. Every rank takes part in gathering
the adapters (actor/weights/adapter_state.py, small at any model size); rank 0 converts them to PEFT's
names (lora/peft.py; q/k/v and gate/up as SGLang's stacked modules, their A sent once), pauses
the servers and, on each server (in parallel, rollout/servers/pool.py
for_each: one that cannot be reached is taken out and the rest go on):
- if it does not hold the adapter yet (the first sync, a restarted server) it loads it with
  SGLang's /load_lora_adapter_from_tensors, carrying this version;
- otherwise the project's loader writes the version in place (rollout/in_server/lora_state.py),
  after checking every tensor's checksum (weight_loader.checksum) on what arrived; a mismatch is
  sent once more, then fails the sync.
Then every server takes the weight version and generation continues. A failure leaves the servers
paused (they may hold a mix of versions) and raises WeightSyncError on every rank, as WeightSync
does; run/recovery.py treats both alike.

Where this differs from full syncs: no deltas (an adapter's every element moves every step), no
owners' buckets (rank 0 holds all of it, the size of one sender's bucket), and the tensor
transport's shared memory: the servers run on the trainer's machines (a remote server needs the
distributed transport's group, which carries no adapter yet).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.actor.weights.adapter_state import full_adapter_state_dict
from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.lora.peft import peft_config, to_peft
from gspo_megatron.sync.tensor import begin_session, post_through_loader, set_version
from gspo_megatron.sync.weight_sync import WeightSyncError, _from_rank0, _no_server
from model_specs.weights.maps import weight_map_for
from rollout.in_server.weight_loader import PART, checksum, path_tensor

if TYPE_CHECKING:
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool


class AdapterSync:
    """The adapters into every server (module docstring); `pool` is used on rank 0 only."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hf_config: Mapping[str, Any],
                 pool: ServerPool | None, settings: LoraSettings, *, name: str = "gspo",
                 pause_mode: str = "retract") -> None:
        if not settings.enabled:
            raise ValueError("AdapterSync: lora.rank is 0 (no adapters to sync)")
        self.chunks, self.hf_config, self.settings = list(chunks), dict(hf_config), settings
        self.wmap = weight_map_for(hf_config)
        self.pool, self.name, self.pause_mode = pool, name, pause_mode
        self.rank = dist.get_rank()
        if self.rank == 0 and pool is None:
            raise ValueError("AdapterSync on rank 0 needs the server pool")
        self.version: str | None = None
        self.stale = False
        self._dtype: torch.dtype | None = None

    def sync(self, version: str | int, again: bool = False) -> dict[str, float]:
        """Collective; the report (WeightSync's keys that mean something here) on rank 0."""
        version = str(version)
        if version == self.version and not again:
            raise ValueError(f"weight version {version!r} is what the servers already serve; "
                             "every sync needs a new version")
        start = time.perf_counter()
        full = full_adapter_state_dict(self.chunks, to_all_ranks=False)
        outcome: tuple[str | None, bool, dict[str, float]] = (None, False, {})
        if self.rank == 0 and full is not None:
            try:
                outcome = (None, False, self._push(full, version))
            except Exception as e:  # noqa: BLE001 - reported on every rank
                outcome = (f"{type(e).__name__}: {e}", _no_server(e), {})
        error, no_server, report = _from_rank0(outcome if self.rank == 0 else None)
        if error is not None:
            self.stale = True
            raise WeightSyncError(f"adapter sync to version {version} failed: {error}. The servers "
                                  "are left paused and may hold another version of the adapter; sync "
                                  "again before generating.", no_server=no_server)
        self.stale, self.version = False, version
        seconds = time.perf_counter() - start
        return {**report, "seconds": seconds,
                "gb_per_s": report["bytes"] / seconds / 1e9 if seconds > 0 else 0.0}

    def _rank0_pool(self) -> ServerPool:
        if self.pool is None:
            raise RuntimeError("AdapterSync: only rank 0 talks to the servers")
        return self.pool

    def _served_dtype(self) -> torch.dtype:
        if self._dtype is None:
            got = {c.served_dtype() for c in self._rank0_pool().sync_clients()}
            got = {self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
                   if d == "auto" else d for d in got}
            if len(got) != 1:
                raise WeightSyncError(f"the servers serve different dtypes {sorted(got)}")
            self._dtype = getattr(torch, str(got.pop()).removeprefix("torch."))
        return self._dtype

    def _push(self, full: dict[str, torch.Tensor], version: str) -> dict[str, float]:
        """Rank 0: pause, the adapter into every server, the version, continue."""
        pool = self._rank0_pool()
        pool.pause_generation(self.pause_mode)
        dtype = self._served_dtype()
        tensors = {k: v.to(dtype).contiguous() for k, v in to_peft(full, self.wmap, fused=True).items()}
        config = peft_config(self.settings, tensors)
        payload = (list(tensors.items())
                   + [(n + PART + "sum", torch.tensor([checksum(t)], dtype=torch.int64)) for n, t in tensors.items()]
                   + [(PART + "lora", path_tensor(self.name))])
        created: list[str] = []
        with tempfile.TemporaryDirectory(prefix="gspo-lora-sync-") as folder:
            def push(client: SGLangClient) -> str:
                begin_session(client)
                if self.name not in client.lora_adapters():
                    client.load_lora_adapter_from_tensors(self.name, tensors, config)
                    created.append(client.url)
                    return "created"
                for attempt in range(2):
                    wrong = post_through_loader(client, payload, Path(folder) / f"{client.url.rsplit(':', 1)[-1]}-{attempt}.json")
                    if not wrong:
                        return "written"
                raise WeightSyncError(f"{client.url}: adapter tensors {wrong[:3]} differ from the "
                                      "trainer's after two writes")
            done = [r for r in pool.for_each(push) if r is not None]
        if not done:
            raise pool.role.lost(", ".join(pool.server_urls),
                                 f"no server is left to take adapter version {version!r} ({pool.summary()})")
        set_version(pool, version)
        pool.for_each(lambda c: c.end_weight_update())
        served = pool.weight_versions()
        wrong = {url: v for url, v in served.items() if v != version}
        if wrong or not served:
            raise WeightSyncError(f"servers report weight versions {wrong or served} after the update, "
                                  f"expected {version!r}")
        pool.synced(version)
        pool.continue_generation()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        # WeightSync's keys (run/loop_metrics.py sync_metrics), meaning the same: a request per server
        return {"bytes": float(nbytes * len(done)), "rank0_bytes": float(nbytes * len(done)),
                "buckets": float(len(done)), "senders": 1.0, "changed_fraction": 1.0,
                "full_syncs": float(len(created)), "checksum_mismatches": 0.0, "attempts": 1.0,
                "adapter_tensors": float(len(tensors))}
