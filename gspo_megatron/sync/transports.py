"""How full HF-named tensors reach the SGLang servers through trainer rank 0 (TRANSPORTS: the
table, by name; sync.senders=rank0). With senders=owners (the default) every owner sends itself
(owner_pass.py; the distributed transport's groups: owner_groups.py), and rank 0 uses only the
transport's sessions or folder, and its finish().

    transport.begin(version)              # before the first bucket
    transport.send(bucket, final=False)   # [(hf_name, tensor), ...], in stream order
    transport.send(last_bucket, final=True)
    transport.finish(version)             # the servers now serve `version`
    transport.abort(version)              # after a failure: undo what the next sync cannot

- DiskTransport: each bucket becomes a safetensors shard of a complete HF model directory (config
  and tokenizer included) on a filesystem the servers can read; finish() makes every server load
  it with /update_weights_from_disk, which also sets the weight version. Atomic per server.
- TensorTransport: /begin_weight_update, one /update_weights_from_tensor per bucket (tensors pass
  by shared memory: server on the same machine), the version set with the last bucket,
  /end_weight_update.
- DistributedTransport: a weights-update process group (trainer rank 0 = group rank 0, the servers'
  ranks after it; gloo on CPU, NCCL on GPU); per bucket /update_weights_from_distributed is posted
  in threads while rank 0 broadcasts the tensors in the same order (docs/cpu.md, "SGLang on CPU").
The servers are reached through rollout.servers.client (ServerPool / SGLangClient).
"""
from __future__ import annotations

import datetime
import gc
import json
import shutil
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gspo_megatron.checkpoint.hf_files import INDEX_NAME, copy_metadata_files
from rollout.servers.health import LIVE, REJOINING

if TYPE_CHECKING:  # duck-typed: anything with ServerPool's methods
    from rollout.servers.pool import ServerPool

Bucket = Sequence[tuple[str, torch.Tensor]]


class Transport(Protocol):
    name: str

    @classmethod
    def for_run(cls, pool: "ServerPool", *, hf_path: str, sync_dir: Callable[[], Path],
                master_address: str) -> "Transport":
        """The transport of a training run (make_transport): hf_path supplies the model's config
        and tokenizer files, sync_dir() a scratch folder the servers can read (made on first
        use), master_address trainer rank 0's address as the servers reach it."""

    def begin(self, version: str) -> None: ...

    def send(self, bucket: Bucket, final: bool, version: str) -> None: ...

    def finish(self, version: str) -> None: ...

    def abort(self, version: str) -> None:
        """After a failed sync: undo what would stop the next one (best effort)."""

    def close(self) -> None: ...


class DiskTransport:
    """Full HF directories under `root` (one per version; the previous one is removed after a
    successful update). `hf_metadata_dir` supplies config.json and the tokenizer files."""

    name = "disk"

    @classmethod
    def for_run(cls, pool: "ServerPool", *, hf_path: str, sync_dir: Callable[[], Path], **_: Any) -> "DiskTransport":
        return cls(pool, sync_dir(), hf_path)

    def __init__(self, pool: "ServerPool", root: str | Path, hf_metadata_dir: str | Path) -> None:
        self.pool, self.root, self.metadata_dir = pool, Path(root), Path(hf_metadata_dir)
        # Weight directories a previous (killed) run left behind are never served again: remove
        # them, so that nothing in `root` predates this run.
        for stale in self.root.glob("weights-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self._dir: Path | None = None
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._current: Path | None = None

    def folder(self, version: str) -> Path:
        """The version's folder (every owner writes its own shards there: sync.senders=owners)."""
        return self.root / f"weights-{version}"

    def adopt(self, weight_map: dict[str, str], total: int) -> None:
        """The shards the owners wrote into the version's folder, for finish()'s index."""
        self._weight_map, self._total = dict(weight_map), int(total)

    def begin(self, version: str) -> None:
        self._dir = self.folder(version)
        if self._dir.exists():
            shutil.rmtree(self._dir)
        copy_metadata_files(self.metadata_dir, self._dir)
        self._weight_map, self._total = {}, 0

    def send(self, bucket: Bucket, final: bool, version: str) -> None:
        fname = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in bucket}, str(self._dir / fname),
                  metadata={"format": "pt"})
        self._weight_map.update({n: fname for n, _ in bucket})
        self._total += sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self, version: str) -> None:
        index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
        (self._dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        self.pool.update_weights_from_disk(str(self._dir), weight_version=version)
        if self._current is not None and self._current != self._dir:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = self._dir

    def abort(self, version: str) -> None:
        """The half-written directory goes (a server that loaded it was paused, and stays so)."""
        if self._dir is not None and self._dir != self._current:
            shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        pass


class TensorTransport:
    """By shared memory: the servers must run on the trainer rank 0's machine."""

    name = "tensor"

    @classmethod
    def for_run(cls, pool: "ServerPool", **_: Any) -> "TensorTransport":
        return cls(pool)

    def __init__(self, pool: "ServerPool") -> None:
        self.pool = pool

    def begin(self, version: str) -> None:
        self.pool.for_each(begin_session)

    def send(self, bucket: Bucket, final: bool, version: str) -> None:
        # The version is set with the last bucket only: a failure before it leaves the old label.
        self.pool.for_each(lambda c: c.update_weights_from_tensor(
            list(bucket), weight_version=version if final else None, flush_cache=final))

    def finish(self, version: str) -> None:
        self.pool.for_each(lambda c: c.end_weight_update())

    def close(self) -> None:
        pass


def begin_session(client) -> None:
    """begin_weight_update; a session left open by a sync that failed between begin and end is
    ended first: SGLang refuses a second one (scheduler_components/weight_updater.py:309-315), so
    without this a failed tensor or distributed sync would block every later one."""
    from rollout.servers.client import SGLangError
    try:
        client.begin_weight_update()
    except SGLangError as e:
        if "already open" not in str(e):
            raise
        client.end_weight_update()
        client.begin_weight_update()


def backend_device(backend: str) -> torch.device:
    """Where a weights-update group's tensors must be: NCCL moves them on the current GPU, gloo on
    the CPU. (The group is not one of torch's registered groups: comm_device cannot ask it its
    backend.)"""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def host_weight_update_store(master_address: str, master_port: int, world_size: int,
                             timeout_s: float):
    """The TCP store of the weights-update group, hosted by trainer rank 0 (group rank 0).
    Created before the servers are asked to join, so that a busy port fails here, not in them."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_weight_update_group(store, world_size: int, group_name: str, backend: str,
                             timeout_s: float):
    """Rank 0 of a process group built as SGLang's init_custom_process_group builds it (a
    PrefixStore named `group_name` over the TCP store), outside the trainer's default group.
    Uses torch's private _new_process_group_helper, as SGLang does."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend),
                                      dist.PrefixStore(group_name, store), group_name=group_name,
                                      backend_options=None,
                                      timeout=datetime.timedelta(seconds=timeout_s))
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class DistributedTransport:
    """Broadcast over a weights-update group. `server_tp_sizes`: each server's TP size (its ranks
    in the group). The group is made of the sync's servers (the pool's live and rejoining ones) at
    the first begin() and kept until close(), or until they change (a server taken out of service,
    or back: rollout/servers/health.py): then the next begin() destroys it and makes a new one of the
    servers there are, on a new port. A member lost during a broadcast is taken out and the send
    raises ServerUnavailable naming it; abort() then breaks the group here (the others' receives
    fail) and WeightSync syncs again on a new group. On GPU, destroying the NCCL group aborts its
    communicator (torch's destroy_process_group); this path is proven with gloo only."""

    name = "distributed"

    @classmethod
    def for_run(cls, pool: "ServerPool", *, master_address: str, **_: Any) -> "DistributedTransport":
        from rollout.servers.ports import free_port
        return cls(pool, master_address, free_port())

    def __init__(self, pool: "ServerPool", master_address: str, master_port: int, *,
                 backend: str | None = None, group_name: str = "gspo_weight_update",
                 server_tp_sizes: Sequence[int] | None = None, timeout_s: float = 300.0) -> None:
        self.pool, self.address, self.port = pool, master_address, int(master_port)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group_name, self.timeout_s = group_name, timeout_s
        tp_sizes = list(server_tp_sizes or [1] * len(pool.clients))
        self.tp_size_of = {c.url: n for c, n in zip(pool.clients, tp_sizes)}
        self._pg = self._store = None
        self._members: list = []  # the clients in the group
        self._made = 0  # groups made so far (each new one gets its own name)

    def _ensure_group(self) -> None:
        members = self.pool.sync_clients()
        changed = [c.url for c in members] != [c.url for c in self._members]
        if self._pg is not None and not changed:
            return
        if self._pg is not None:
            self._drop_group()
        if self._made:
            from rollout.servers.ports import free_port
            self.port = free_port(self.address)  # the old store's port may still be held
        sizes = [self.tp_size_of[c.url] for c in members]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        self._made += 1
        name = self.group_name if self._made == 1 else f"{self.group_name}_{self._made}"
        self._store = host_weight_update_store(self.address, self.port, world, self.timeout_s)
        # Each server blocks in this call until every rank has joined: post them in threads.
        joins = [self.pool.submit(c.init_weights_update_group, self.address, self.port, off, world,
                                  name, self.backend, self.timeout_s)
                 for c, off in zip(members, offsets)]
        self._pg = join_weight_update_group(self._store, world, name, self.backend, self.timeout_s)
        for f in joins:
            f.result(timeout=self.timeout_s)
        self._members, self._name = members, name

    def _drop_group(self) -> None:
        """Destroy the group here, then on its servers still there (a lost one has nothing to
        destroy). Here first: a server still waiting in a broadcast (after a failed send) fails its
        receive only once this side's sockets close, and answers nothing before."""
        dist.destroy_process_group(self._pg)
        self._pg = self._store = None
        gc.collect()  # the group freed now: its sockets close, the servers' receives fail
        for c in self._members:
            if self.pool.status(c.url) in (LIVE, REJOINING):
                try:
                    c.destroy_weights_update_group(self._name)
                except Exception:  # noqa: BLE001 - it may have lost the group with a failed update
                    pass

    def begin(self, version: str) -> None:
        self._ensure_group()
        # Must succeed before any broadcast: a server outside begin/end answers 400 to the update
        # and never joins the broadcast (docs/cpu.md).
        self.pool.for_each(begin_session)

    def send(self, bucket: Bucket, final: bool, version: str) -> None:
        device = backend_device(self.backend)
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        replies = {c.url: self.pool.submit(c.update_weights_from_distributed, names, dtypes, shapes,
                                           self._name, version if final else None,
                                           flush_cache=final) for c in self._members}
        error = self._broadcast(bucket, device, replies)
        if error is None:
            try:
                for f in replies.values():
                    f.result(timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - raised below, a lost server named
                error = e
        if error is not None:
            lost = self._lost_members(replies)
            if lost:  # WeightSync runs the sync again on the servers there are
                from rollout.servers.client import ServerUnavailable
                raise ServerUnavailable(lost[0], f"lost during the weights broadcast "
                                        f"({type(error).__name__}: {error})") from error
            raise error

    def _broadcast(self, bucket: Bucket, device, replies: dict[str, Any]) -> Exception | None:
        """Broadcast the bucket's tensors in order; the first failure, returned with its frames'
        locals cleared: nothing may keep the collective's Work, and with it the group, alive once
        abort() destroys the group, for a server still waiting in the broadcast fails its receive
        only when this side's sockets close (tried with gloo: at once then, else at the timeout)."""
        error: Exception | None = None
        for _, t in bucket:
            work = dist.broadcast(t.to(device).contiguous(), group_src=0, group=self._pg, async_op=True)
            # A server that refused the request, or was lost, never joins this broadcast: stop
            # waiting then.
            while error is None and not work.is_completed():
                failed = [f for f in replies.values() if f.done() and f.exception() is not None]
                out = [u for u in replies if self.pool.status(u) not in (LIVE, REJOINING)]
                if failed:
                    error = failed[0].exception()
                elif out:
                    error = ConnectionError(f"{out[0]} was taken out of service during the broadcast "
                                            f"({self.pool.reason(out[0])})")
                else:
                    time.sleep(0.001)
            if error is None:
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - returned
                    error = e
            work = None
            if error is not None:
                traceback.clear_frames(error.__traceback__)
                return error
        return None

    def _lost_members(self, replies: dict[str, Any]) -> list[str]:
        """After a failed broadcast: the members that are gone (taken out already, their request's
        connection failed, or /model_info unanswered within 5 s), taken out of service now."""
        from rollout.servers.client import ServerUnavailable
        from rollout.servers.health import probe
        lost = []
        for url, reply in replies.items():
            if self.pool.status(url) not in (LIVE, REJOINING):
                lost.append(url)
                continue
            failure = reply.exception() if reply.done() else None
            why = (failure.message if isinstance(failure, ServerUnavailable) else
                   probe(url, 5.0, generate=False))
            if why is not None:
                self.pool.take_out(url, f"lost during a weight sync: {why}")
                lost.append(url)
        return lost

    def abort(self, version: str) -> None:
        """After a failed send: the group goes (_drop_group); the next begin() makes a new one, on
        a new port, of the servers there are, and ends their weight-update sessions first."""
        if self._pg is not None:
            self._drop_group()
            self._members = []

    def finish(self, version: str) -> None:
        self.pool.for_each(lambda c: c.end_weight_update())

    def close(self) -> None:
        if self._pg is not None:
            self._drop_group()


# The transports by name (sync.transport in the run config, whose Literal lists the same names).
TRANSPORTS: dict[str, type] = {t.name: t for t in (DiskTransport, TensorTransport, DistributedTransport)}


def make_transport(name: str, pool: "ServerPool", *, hf_path: str, sync_dir: Callable[[], Path],
                   master_address: str) -> Transport:
    """The transport `name` of TRANSPORTS, built for a training run (Transport.for_run)."""
    if name not in TRANSPORTS:
        raise ValueError(f"sync.transport={name!r}: expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name].for_run(pool, hf_path=hf_path, sync_dir=sync_dir, master_address=master_address)
