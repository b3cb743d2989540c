"""The rollout batch from rank 0 to the ranks that train it: each rank receives only its own rows,
packed without padding, over the backend (NCCL on GPU, gloo on CPU).

    out = scatter_rows(rank, make, dp_rank=..., dp_size=..., num_mini_batches=4, work=work_fn,
                       route_layers=actor.routing.layers)
    # None (rank 0's `make` returned None: every rank gets None), or
    # (shard, extras, stats): this rank's TrainBatch, packed (equal to shard(...) of the global
    # batch, packed, with only this pipeline stage's routing layers), rank 0's small side results
    # (metrics), and what the transfer cost

Before (issue 29): rank 0 pickled the whole right-padded batch and broadcast it to every rank, and
each rank kept its own rows. At 1,024 rows of up to 20k tokens that was 0.41 GiB and 5 s per step
on 4 gloo ranks; with routing replay at 48 layers x top-8 it could not run at all.

Now rank 0 (which holds the step's batch packed, rollout_batch.samples_to_batch):
1. plans the shards (balance.plan_shards: mini-batch j's rows shared by work), once;
2. broadcasts a small header (pickled: the metrics and each DP rank's manifest of field names,
   dtypes and shapes: O(DP x fields), not O(tokens));
3. for one DP rank at a time, packs its rows (a per-row field as it is, a per-token field as its
   rows' real tokens concatenated; every field viewed as bytes, one buffer) and sends it to the
   ranks of that replica (TP/PP/CP peers get the same one; expert-parallel ranks are carved out
   of data parallelism and have rows of their own); then, per pipeline stage of the replica, a
   second buffer with the routing replay layers that stage owns (uint8 expert ids, 255 = none, up
   to 255 experts);
4. frees each buffer once sent: besides the batch, rank 0 holds one DP rank's rows at a time.
A rank allocates its buffers from the manifest, receives, and keeps them as its packed TrainBatch:
what it holds is its own rows' real tokens and its own stage's layers, not the step's batch, its
longest row or every layer. The actor pads per micro-batch only (microbatches.micro_batch).

Not done: a relay inside a replica (rank 0 sends each of a replica's ranks its buffer itself).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import fields
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.actor.balance import plan_shards, worst_imbalance
from gspo_megatron.actor.batch import NOT_TENSORS, TrainBatch, compact_routes
from gspo_megatron.parallel.comm import comm_device



def _fields(batch: TrainBatch, rows: torch.Tensor):
    """(name, kind, dtype, shape) of each tensor field of `rows` of a packed batch, routes aside."""
    real = int(batch.lengths[rows].sum())
    out = []
    for f in fields(batch):
        t = batch.global_rows if f.name == "global_rows" else getattr(batch, f.name)
        if f.name == "global_rows" and t is None:
            t = torch.empty(batch.num_rows, dtype=torch.long)
        if t is None or f.name in NOT_TENSORS or f.name == "routed_experts":
            continue
        token = batch.is_token_field(f.name)
        out.append((f.name, "token" if token else "row", str(t.dtype).removeprefix("torch."),
                    ((real if token else len(rows)), *t.shape[1:])))
    return out


def _route_manifest(batch: TrainBatch, rows: torch.Tensor, layers: list[int] | None):
    if batch.routed_experts is None:
        return []
    t = batch.routed_experts
    n = t.shape[1] if layers is None else len(layers)
    return [("routed_experts", "token", str(t.dtype).removeprefix("torch."),
             (int(batch.lengths[rows].sum()), n, t.shape[2]))]


def pack(batch: TrainBatch, rows: list[int], *, routes: bool = True, layers: list[int] | None = None,
         ) -> tuple[list[tuple[str, str, str, tuple[int, ...]]], torch.Tensor]:
    """(manifest: (field, "row" or "token", dtype, shape) each, one uint8 buffer) of `rows` of
    `batch` (packed; a padded one is packed first): per-token fields without padding. routes=False
    leaves routed_experts out; routes only: `pack_routes`."""
    batch = batch.packed()
    index = torch.tensor(rows, dtype=torch.long)
    flat = batch._row_positions(index)
    global_rows = batch.global_rows if batch.global_rows is not None else torch.arange(batch.num_rows)
    parts = []
    manifest = _fields(batch, index)
    for name, kind, _, _ in manifest:
        t = global_rows if name == "global_rows" else getattr(batch, name)
        parts.append(t[flat] if kind == "token" else t[index])
    if routes:
        m, buf = pack_routes(batch, rows, layers)
        manifest += m
        parts.append(buf)
    return manifest, _join(parts)


def pack_routes(batch: TrainBatch, rows: list[int], layers: list[int] | None = None):
    """(manifest, buffer) of the routing replay layers `layers` (None: all) of `rows`: compact
    (compact_routes), one entry per real token and layer."""
    batch = batch.packed()
    index = torch.tensor(rows, dtype=torch.long)
    t = batch.routed_experts
    if t is None:
        return [], torch.empty(0, dtype=torch.uint8)
    t = compact_routes(t)
    picked = t[batch._row_positions(index)]
    if layers is not None:
        picked = picked[:, torch.tensor(layers, dtype=torch.long)]
    picked = picked.contiguous()
    return [("routed_experts", "token", str(picked.dtype).removeprefix("torch."), tuple(picked.shape))], \
        _join([picked])


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    out = []
    for p in parts:
        raw = p.contiguous().reshape(-1).view(torch.uint8)
        out += [raw, torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def _nbytes(manifest) -> int:
    return sum(_aligned(getattr(torch, dt).itemsize * int(torch.Size(shape).numel()))
               for _, _, dt, shape in manifest)


def unpack(manifest: list, buffer: torch.Tensor, mini_batch_sizes: list[int],
           dp_token_imbalance: float, route_layers: list[int] | None = None) -> TrainBatch:
    """The packed TrainBatch of a received buffer (the manifest's fields, views of the buffer's
    own memory: nothing copied, nothing padded)."""
    out, offset = {}, 0
    for name, _, dtype, shape in manifest:
        dt = getattr(torch, dtype)
        n = dt.itemsize * int(torch.Size(shape).numel())
        out[name] = buffer[offset:offset + n].view(dt).reshape(shape)
        offset += _aligned(n)
    if offset != buffer.numel():
        raise ValueError(f"packed rows: {buffer.numel()} bytes received, the manifest accounts for {offset}")
    return TrainBatch(**out, mini_batch_sizes=mini_batch_sizes, dp_token_imbalance=dp_token_imbalance,
                      route_layers=route_layers if "routed_experts" in out else None)


def _aligned(nbytes: int) -> int:
    """Each field starts at a multiple of 8 bytes of the buffer (a view as int64 needs it)."""
    return -(-nbytes // 8) * 8


def _who_is_who(my_dp_rank: int, layers: list[int] | None) -> list[tuple[int, tuple[int, ...] | None]]:
    """(DP rank, routing layers) of every rank (a small all_gather of objects, once per step)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (my_dp_rank, None if layers is None else tuple(layers)))
    return every


def scatter_rows(rank: int, make: Callable[[], tuple[TrainBatch, Any] | None], *, dp_rank: int,
                 dp_size: int, num_mini_batches: int,
                 work: Callable[[list[int]], list[float]] | None = None,
                 route_layers: list[int] | None = None,
                 ) -> tuple[TrainBatch, Any, dict[str, float]] | None:
    """Run `make` on rank 0 ((batch, extras) or None) and give each rank its shard of the batch
    (see the module docstring), with rank 0's `extras` and the transfer's stats:
    `bytes_per_rank` (the most any rank received) and `batch_transfer_s` (rank 0: the header,
    packing and every send; a receiver: its receives); the shard carries `dp_token_imbalance`.
    route_layers: the routing layers this rank's pipeline stage owns (None: all). If `make`
    raises on rank 0, every rank raises (rank 0 the original error, the others
    driver.DriverError), as driver.on_driver."""
    from gspo_megatron.driver import DriverError, broadcast_object
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    who = _who_is_who(dp_rank, route_layers) if distributed else [(dp_rank, None if route_layers is None else tuple(route_layers))]
    header, batch, plan, error = None, None, None, None
    t0 = time.perf_counter()
    if rank == 0:
        try:
            got = make()
            t0 = time.perf_counter()  # the transfer: the header, packing, every send
            if got is None:
                header = ("none",)
            else:
                batch, extras = got
                batch = batch.packed()
                if batch.routed_experts is not None:  # one byte per expert id (as samples_to_batch)
                    batch = dataclasses.replace(batch, routed_experts=compact_routes(batch.routed_experts))
                lengths = batch.lengths.tolist()
                plan = plan_shards(batch.num_rows, dp_size, num_mini_batches,
                                   work(lengths) if work is not None else None)
                imbalance = worst_imbalance(lengths, plan)
                manifests, most = {}, 0
                for d in range(dp_size):
                    index = torch.tensor([i for parts in plan for i in parts[d]], dtype=torch.long)
                    common = _fields(batch, index)
                    routes = {key: _route_manifest(batch, index, None if key is None else list(key))
                              for key in {k for dd, k in who if dd == d}}
                    manifests[d] = (common, routes, [len(parts[d]) for parts in plan])
                    most = max([most] + [_nbytes(common) + _nbytes(r) for r in routes.values()])
                header = ("ok", extras, manifests, imbalance, most)
        except Exception as e:  # noqa: BLE001 - re-raised below after telling the other ranks
            error = e
            header = ("error", f"{type(e).__name__}: {e}", type(e).__name__)
    header = broadcast_object(header)
    if error is not None:
        raise error
    if header[0] == "error":
        raise DriverError(f"rank 0 failed: {header[1]}", header[2])
    if header[0] == "none":
        return None
    _, extras, manifests, imbalance, most_bytes = header
    common, routes, sizes = manifests[dp_rank]
    my_key = who[rank][1]
    if rank == 0:
        mine = _send_all(batch, plan, who, dp_size, dp_rank, my_key)
        del batch
    else:
        t0 = time.perf_counter()
        mine = [_receive(common)]
        if routes.get(my_key):
            mine.append(_receive(routes[my_key]))
    shard = unpack(common, mine[0], sizes, imbalance)
    if routes.get(my_key):  # this stage's routing layers
        shard = dataclasses.replace(shard, routed_experts=_routes_view(routes[my_key], mine[1]),
                                    route_layers=None if my_key is None else list(my_key))
    stats = {"bytes_per_rank": float(most_bytes), "batch_transfer_s": time.perf_counter() - t0}
    return shard, extras, stats


def _routes_view(manifest, buffer: torch.Tensor) -> torch.Tensor:
    (_, _, dtype, shape), = manifest
    dt = getattr(torch, dtype)
    return buffer[:dt.itemsize * int(torch.Size(shape).numel())].view(dt).reshape(shape)


def _receive(manifest) -> torch.Tensor:
    nbytes = _nbytes(manifest)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=comm_device())
    if nbytes:  # rank 0 sends nothing for no rows
        dist.recv(buffer, src=0)
    return buffer.cpu()


def _send_all(batch: TrainBatch, plan, who, dp_size: int, my_dp: int, my_key) -> list[torch.Tensor]:
    """Rank 0: pack and send each DP rank's rows (then each stage's routes), one DP rank's buffers
    at a time; returns rank 0's own buffers."""
    device, mine = comm_device(), None
    for d in range(dp_size):
        rows = [i for parts in plan for i in parts[d]]
        _, common = pack(batch, rows, routes=False)
        receivers = [r for r in range(1, len(who)) if who[r][0] == d]
        _send(common, receivers, device)
        keys = {k for dd, k in who if dd == d}
        own = {}
        for key in keys:
            _, buf = pack_routes(batch, rows, None if key is None else list(key))
            _send(buf, [r for r in receivers if who[r][1] == key], device)
            own[key] = buf
        if d == my_dp:
            mine = [common, own.get(my_key)]
    return mine


def _send(buffer: torch.Tensor, receivers: list[int], device) -> None:
    if not receivers or not buffer.numel():
        return
    on_device = buffer.to(device)
    for s in [dist.isend(on_device, dst=r) for r in receivers]:
        s.wait()
