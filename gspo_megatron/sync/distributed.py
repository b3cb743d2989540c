"""The distributed transport: each sender broadcasts its requests over a weights-update process
group of its own with each server (this sender = group rank 0, that server's TP ranks after it;
NCCL on GPU, gloo on CPU), made on first use and kept across syncs. Nothing passes through a shared
file system or shared memory, so senders and servers may sit on different machines.

    transport = DistributedTransport(pool)   # rank 0: sessions and version as the tensor transport's
    groups = WeightUpdateGroups()            # every sender, kept in its SenderState
    failures = groups.ensure(client_of, targets, regroup, server_tp, timeout_s)
    w = groups.wire(parts, delta)            # once per request and mode
    mismatched = groups.post(client, w, timeout_s)

A post is SGLang's /update_weights_from_distributed: names, dtypes and shapes over HTTP, then the
request's tensors as one broadcast of their bytes, built once per request for every server
(load_format "flattened_bucket", the tensors ordered by element size so that each one's offset is
a multiple of it, as SGLang's receive requires). A delta goes through the project's loader
(rollout/in_server/weight_loader.py routes the model's load_weights to it), which broadcasts its
checksum report back over the same group (from group rank 1).

Why a group per sender and server: a server takes one request at a time. Two servers that took
two senders' requests in opposite orders would each wait in a broadcast of a group spanning both
for a member busy with the other; with a group per pair each queued request waits only on its own
sender, who posted it and is broadcasting it. A failed post breaks its group here at once (a
server still waiting in a receive fails it only once this side's sockets close) and the next pass
makes a new one, first asking the server to destroy the old; a server that came back holds none
of its groups (rank 0 lists it in `regroup`).

What it costs: every server rank joins one group per sender, (PP x EP senders) communicators
(NCCL: each with its own buffers, NCCL_BUFFSIZE 4 MiB by default, per channel; set it lower where
senders are many). Joining is bounded by the timeout; a server that never joins costs it once.
On GPU the groups are NCCL's; this path is proven with gloo only.
"""
from __future__ import annotations

import datetime
import gc
import json
import socket
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from gspo_megatron.sync.tensor import TensorTransport
from gspo_megatron.sync.transport_base import Parts, Sender, SenderState
from rollout.in_server.weight_loader import REPLY

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName
    from rollout.servers.pool import ServerPool


@dataclass
class Wire:
    """A request as one broadcast: its entries' names, dtypes and shapes (sent over HTTP) and their
    bytes concatenated, one tensor on the groups' device that every server's post reads."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor
    delta: bool


@dataclass
class GroupSender(Sender[Wire]):
    """Posts each request over this rank's group with the server."""

    server_tp: dict[str, int] = field(default_factory=dict)  # each server's TP size (its group ranks)
    regroup: list[str] = field(default_factory=list)         # servers that came back: new groups
    timeout_s: float = 300.0                                  # a group's join, and each broadcast

    def open(self, state: SenderState, targets: dict[str, str]) -> dict[str, Exception]:
        groups = state.kept("distributed", WeightUpdateGroups)
        return groups.ensure(state.client, targets, self.regroup, self.server_tp, self.timeout_s)

    def pack(self, state: SenderState, mode: str, parts: Parts) -> Wire:
        return state.kept("distributed", WeightUpdateGroups).wire(parts, mode == "delta")

    def post(self, state: SenderState, url: str, packed: Wire) -> list[str]:
        return state.kept("distributed", WeightUpdateGroups).post(state.client(url), packed, self.timeout_s)


class DistributedTransport(TensorTransport):
    """Over the senders' weights-update groups; `server_tp_sizes`: each server's TP size."""

    name = "distributed"
    sender_type = GroupSender

    def __init__(self, pool: ServerPool, *, server_tp_sizes: Sequence[int] | None = None,
                 timeout_s: float = 300.0) -> None:
        super().__init__(pool)
        self.timeout_s = timeout_s
        self.tp_size_of = {c.url: n for c, n in zip(pool.clients, server_tp_sizes or [1] * len(pool.clients))}

    @classmethod
    def for_run(cls, pool: ServerPool, **_: object) -> DistributedTransport:
        """Not the tensor transport's: an update group per server takes no CUDA IPC setting."""
        return cls(pool)

    def sender(self, version: str, targets: dict[str, str]) -> Sender[Any]:
        from rollout.servers.health import LIVE
        return GroupSender(dict(self.tp_size_of), [u for u in targets if self.pool.status(u) != LIVE],
                           self.timeout_s)


def backend_device(backend: str) -> torch.device:
    """Where a weights-update group's tensors must be: NCCL moves them on the current GPU, gloo on
    the CPU. (The group is not one of torch's registered groups: comm_device cannot ask it.)"""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at `url` (what the server can reach)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet leaves, the kernel only picks the route
        return s.getsockname()[0]


def join_group(address: str, port: int, world_size: int, name: str, backend: str, timeout_s: float):
    """Rank 0 of a process group built as SGLang's init_custom_process_group builds it (a
    PrefixStore named `name` over a TCP store this rank hosts), outside the trainer's default
    group; returns (group, store). Uses torch's private _new_process_group_helper, as SGLang does."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    # the name is torch 2.14's GroupName, a NewType of str that older versions lack: a cast, no import
    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), dist.PrefixStore(name, store),
                                      group_name=cast("GroupName", name), backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg, store


def _wait(work, reply: Future, deadline: float, what: str) -> None:
    """Wait for one collective, failing as soon as the server's request fails, or when the server
    answered and the collective still did not complete (it never took part), or at the deadline."""
    answered_at = None
    pause = 0.0005
    while not work.is_completed():
        if reply.done():
            error = reply.exception()
            if error is not None:
                raise error
            answered_at = answered_at or time.monotonic()
            if time.monotonic() - answered_at > 5.0:
                raise RuntimeError(f"the server answered without taking part in the {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {what} did not complete within the sync's timeout")
        # backing off: every sender polls while the servers apply, and where they share cores
        # (a colocated node) a tight poll takes the servers' CPU
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    work.wait()


class WeightUpdateGroups:
    """One sender's groups, one per server (module docstring)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:8]  # group names unique across trainer processes
        self.made = 0
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        # url -> (process group, name, its store: kept alive, NCCL makes its communicator at the
        # first collective, through the store)
        self.groups: dict[str, tuple] = {}
        self.dropped: dict[str, list[str]] = {}      # url -> names the server may still hold
        self.http = ThreadPoolExecutor(64, thread_name_prefix="gspo-weight-group")

    def ensure(self, client_of: Callable[[str], Any], targets: dict[str, str], regroup: Sequence[str],
               server_tp: dict[str, int], timeout_s: float) -> dict[str, Exception]:
        """A group with every target (remade for `regroup`); the servers that could not join."""
        from rollout.servers.client import ServerUnavailable
        failures: dict[str, Exception] = {}
        for url in targets:
            if url in regroup:
                self.drop(url)
            if url in self.groups:
                continue
            try:
                self._make(client_of(url), server_tp.get(url, 1), timeout_s)
            except ServerUnavailable as e:
                failures[url] = e
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                failures[url] = RuntimeError(f"joining a weights-update group with {url}: "
                                             f"{type(e).__name__}: {e}")
        return failures

    def _make(self, client, tp: int, timeout_s: float) -> None:
        from rollout.servers.ports import free_port
        for old in self.dropped.pop(client.url, []):
            try:  # best effort: a group a failed pass broke (a restarted server has none)
                client.destroy_weights_update_group(old)
            except Exception:  # noqa: BLE001
                pass
        address = address_towards(client.url)
        port = free_port(address)
        self.made += 1
        name = f"gspo_owner_{self.token}_r{dist.get_rank()}_{self.made}"
        world = 1 + int(tp)
        # the server blocks in its join until every rank has joined: post it, then join here
        join = self.http.submit(client.init_weights_update_group, address, port, 1, world, name,
                                self.backend, timeout_s)
        pg, store = join_group(address, port, world, name, self.backend, timeout_s)
        try:
            join.result(timeout=timeout_s)
        except Exception:
            dist.destroy_process_group(pg)
            raise
        self.groups[client.url] = (pg, name, store)

    def drop(self, url: str) -> None:
        """Break the group with `url` here (its sockets close, a receive waiting there fails)."""
        got = self.groups.pop(url, None)
        if got is None:
            return
        pg, name, _ = got
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - already broken
            pass
        pg = got = None
        gc.collect()
        self.dropped.setdefault(url, []).append(name)

    def wire(self, parts: Parts, delta: bool) -> Wire:
        """The parts as one broadcast (a delta's with the loader's |reply= entry, whose name each
        post completes with its group's)."""
        parts = list(parts) + ([(REPLY, torch.zeros(1, dtype=torch.uint8))] if delta else [])
        parts.sort(key=lambda nt: -nt[1].element_size())  # stable: the loader's order within a size
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in parts])
        return Wire([n for n, _ in parts], [str(t.dtype).removeprefix("torch.") for _, t in parts],
                    [list(t.shape) for _, t in parts], flat.to(backend_device(self.backend)), delta)

    def post(self, client, w: Wire, timeout_s: float) -> list[str]:
        """One request to one server; the names whose checksum the loader found different."""
        from rollout.servers.client import ServerUnavailable
        from rollout.servers.health import probe
        pg, name, _ = self.groups[client.url]
        device = backend_device(self.backend)
        reply = self.http.submit(client.update_weights_from_distributed,
                                 [n + name if n == REPLY else n for n in w.names], w.dtypes, w.shapes,
                                 name, None, flush_cache=False, load_format="flattened_bucket",
                                 timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            _wait(dist.broadcast(w.flat, group_src=0, group=pg, async_op=True), reply, deadline,
                  "weights broadcast")
            got: dict = {}
            if w.delta:
                n = torch.zeros(1, dtype=torch.int64, device=device)
                _wait(dist.broadcast(n, group_src=1, group=pg, async_op=True), reply, deadline,
                      "loader's report")
                data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
                _wait(dist.broadcast(data, group_src=1, group=pg, async_op=True), reply, deadline,
                      "loader's report")
                got = json.loads(bytes(data.cpu().tolist()).decode())
            reply.result(timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:
            traceback.clear_frames(e.__traceback__)  # nothing may keep the group's Work alive
            self.drop(client.url)
            if isinstance(e, ServerUnavailable):
                raise
            why = probe(client.url, 5.0, generate=False)
            if why is not None:
                raise ServerUnavailable(client.url, f"lost during the weights broadcast ({why}; "
                                        f"{type(e).__name__}: {e})") from None
            raise
        if got.get("error"):
            raise RuntimeError(f"{client.url}: the weight loader failed: {got['error']}")
        return list(got.get("mismatched", []))
