"""The distributed transport's weights-update groups of one sender (owner_pass.py): one group per
server, of this sender (group rank 0) and that server's TP ranks (group ranks 1..tp), made on
first use and kept across syncs.

    groups = OwnerGroups()
    lost, error = groups.ensure(client_of, plan)        # every target has a group
    w = groups.wire(payload, delta)                     # once per bucket and mode
    mismatched = groups.post(client, w, timeout_s)      # per server

A post is SGLang's /update_weights_from_distributed (names, dtypes and shapes over HTTP, then the
bucket's tensors as one broadcast of their bytes, built once per bucket for every server:
load_format "flattened_bucket", the tensors ordered by element size so that each one's offset is
a multiple of it, as SGLang's receive requires). A delta payload goes through the project's
loader (rollout/in_server/weight_loader.py routes the model's load_weights to it), which broadcasts its
checksum report back over the same group (from group rank 1). A failed post breaks its group
here at once (a server still waiting in a receive fails it only once this side's sockets close;
DistributedTransport._drop_group says the same), and the next pass makes a new one, first asking
the server to destroy the old one.

What it costs: every server rank joins one group per sender, so it holds (PP x EP senders)
communicators (NCCL: each with its own buffers, NCCL_BUFFSIZE 4 MiB by default, per channel; set it
lower where senders are many). The trainer holds one group per server per sender. Joining is
bounded by the plan's timeout; a server that never joins costs that timeout once.
"""
from __future__ import annotations

import gc
import json
import socket
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from gspo_megatron.sync.transports import (backend_device, host_weight_update_store,
                                           join_weight_update_group)
from rollout.in_server.weight_loader import REPLY


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at `url` (what the server can reach)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet leaves, the kernel only picks the route
        return s.getsockname()[0]


def _wait(work, reply: Future, deadline: float, what: str) -> None:
    """Wait for one collective, failing as soon as the server's request fails, or when the server
    answered and the collective still did not complete (it never took part), or at the deadline."""
    answered_at = None
    pause = 0.0005
    while not work.is_completed():
        if reply.done():
            if reply.exception() is not None:
                raise reply.exception()
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


@dataclass
class Wire:
    """A bucket as one broadcast: its entries' names, dtypes and shapes (sent over HTTP) and their
    bytes concatenated, one tensor on the groups' device that every server's post reads."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor
    delta: bool


class OwnerGroups:
    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:8]  # group names unique across trainer processes
        self.made = 0
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        # url -> (process group, name, its store: kept alive, NCCL makes its communicator at the
        # first collective, through the store)
        self.groups: dict[str, tuple] = {}
        self.dropped: dict[str, list[str]] = {}      # url -> names the server may still hold
        self.http = ThreadPoolExecutor(64, thread_name_prefix="gspo-owner-group")

    def ensure(self, client_of: Callable[[str], Any], plan) -> tuple[list[str], str | None]:
        """A group with every target of the pass (remade for plan.regroup: servers that came back
        hold none). Returns (lost servers, first error)."""
        from rollout.servers.client import ServerUnavailable
        lost, error = [], None
        for url in plan.targets:
            if url in plan.regroup:
                self.drop(url)
            if url in self.groups:
                continue
            try:
                self._make(client_of(url), plan.server_tp.get(url, 1), plan.timeout_s)
            except ServerUnavailable as e:
                lost.append(url)
                error = error or f"ServerUnavailable: {e}"
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                error = error or f"{type(e).__name__}: joining a weights-update group with {url}: {e}"
        return lost, error

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
        store = host_weight_update_store(address, port, world, timeout_s)
        # the server blocks in this call until every rank has joined: post it, then join here
        join = self.http.submit(client.init_weights_update_group, address, port, 1, world, name,
                                self.backend, timeout_s)
        pg = join_weight_update_group(store, world, name, self.backend, timeout_s)
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

    def wire(self, payload: Sequence[tuple[str, torch.Tensor]], delta: bool) -> Wire:
        """The payload as one broadcast (a delta's with the loader's |reply= entry, whose name each
        post completes with its group's)."""
        payload = list(payload) + ([(REPLY, torch.zeros(1, dtype=torch.uint8))] if delta else [])
        payload.sort(key=lambda nt: -nt[1].element_size())  # stable: the loader's order within a size
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in payload])
        return Wire([n for n, _ in payload], [str(t.dtype).removeprefix("torch.") for _, t in payload],
                    [list(t.shape) for _, t in payload], flat.to(backend_device(self.backend)), delta)

    def post(self, client, w: Wire, timeout_s: float) -> list[str]:
        """One bucket to one server; the names whose checksum the loader found different."""
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
