"""The rollout batch from rank 0 to the ranks that train it: each rank receives only its own rows,
packed without padding, over the backend (NCCL on GPU, gloo on CPU).

    out = scatter_rows(rank, make, dp_rank=..., dp_size=..., num_mini_batches=4, work=work_fn,
                       route_layers=actor.routing.layers, replica_group=ps.get_model_parallel_group(),
                       stage_group=ps.get_tensor_model_parallel_group())
    # None (rank 0's `make` returned None: every rank gets None), or
    # (shard, extras, stats): this rank's TrainBatch, packed (equal to shard(...) of the global
    # batch, packed, with only this pipeline stage's routing layers), rank 0's small side results
    # (metrics), and what the transfer cost

Why not broadcast the batch: pickling the whole right-padded batch to every rank, which then keeps
its own rows, moved 0.41 GiB per step at 1,024 rows of up to 20k tokens on 4 gloo ranks, and with
routing replay at 48 layers x top-8 could not run at all (docs/results.md, the data path).

Rank 0 (which holds the step's batch packed, driver/samples_to_batch.py):
1. plans the shards (balance.plan_shards: mini-batch j's rows shared by work), once;
2. broadcasts a small header (pickled: the metrics and each DP rank's manifest of field names,
   dtypes and shapes: O(DP x fields), not O(tokens));
3. for one DP rank at a time, packs its rows (a per-row field as it is, a per-token field as its
   rows' real tokens concatenated; every field viewed as bytes, one buffer) and sends it once to
   each replica unit of that DP rank, whose leader broadcasts it over the unit's group (_Relay:
   TP/PP peers hold the same rows; CP peers and a layout without usable groups get their own
   copies; expert-parallel ranks are carved out of data parallelism and have rows of their own);
   then, per pipeline stage of the replica, a second buffer with the routing replay layers that
   stage owns (uint8 expert ids, 255 = none, up to 255 experts), relayed over the stage's
   tensor-parallel group alike;
4. frees each buffer once sent: besides the batch, rank 0 holds one DP rank's rows at a time.
A rank allocates its buffers from the manifest, receives, and keeps them as its packed TrainBatch:
what it holds is its own rows' real tokens and its own stage's layers, not the step's batch, its
longest row or every layer. The actor pads per micro-batch only (micro_batch.micro_batch).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import fields
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.actor.batching.balance import plan_shards, worst_imbalance
from gspo_megatron.actor.batching.batch import NOT_TENSORS, TrainBatch, compact_routes
from gspo_megatron.parallel.comm import comm_device
from gspo_megatron.parallel.rank_zero import DriverError, broadcast_object


def _fields(batch: TrainBatch, rows: torch.Tensor):
    """(name, kind, dtype, shape) of each tensor field of `rows` of a packed batch, routes aside."""
    real = int(batch.lengths[rows].sum())
    out = []
    for f in fields(batch):
        t = getattr(batch, f.name)
        if f.name == "global_rows" and t is None:  # sent as the rows' indices (pack)
            t = torch.empty(batch.num_rows, dtype=torch.long)
        if t is None or f.name in NOT_TENSORS or f.name == "routed_experts":
            continue
        token = batch.is_token_field(f.name)
        out.append((f.name, "token" if token else "row", str(t.dtype).removeprefix("torch."),
                    ((real if token else len(rows)), *t.shape[1:])))
    return out


def _route_manifest(batch: TrainBatch, rows: torch.Tensor, layers: list[int] | None):
    """pack_routes' manifest, for a batch whose routes are compact already (scatter_rows)."""
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
    lo, n = 0, t.shape[1]
    if layers is not None and layers and layers != list(range(layers[0], layers[0] + len(layers))):
        t = t[:, torch.tensor(layers, dtype=torch.long)]  # not one range of layers (rare): a copy
        n = len(layers)
    elif layers is not None:  # a stage's range of layers
        lo, n = (layers[0] if layers else 0), len(layers)
    # Row by row into one buffer: each row's tokens are one block of the packed routes, so these
    # are plain block copies (7x faster than one advanced-indexing gather at 2,048 rows x 48 x 8).
    starts, lengths = batch.offsets[:-1][index].tolist(), batch.lengths[index].tolist()
    picked = torch.empty((sum(lengths), n, t.shape[2]), dtype=t.dtype)
    at = 0
    for start, length in zip(starts, lengths):
        picked[at:at + length] = t[start:start + length, lo:lo + n]
        at += length
    return [("routed_experts", "token", str(picked.dtype).removeprefix("torch."), tuple(picked.shape))], \
        _join([picked])


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1 and parts[0].is_contiguous() and parts[0].nbytes % 8 == 0:
        return parts[0].reshape(-1).view(torch.uint8)  # no copy (routes: the largest part)
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


def _who_is_who(my_dp_rank: int, layers: list[int] | None, replica_group, stage_group) -> list[tuple]:
    """(DP rank, routing layers, replica group's ranks, stage group's ranks) of every rank (a small
    all_gather of objects, once per step)."""
    def ranks(group):
        return None if group is None else tuple(dist.get_process_group_ranks(group))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (my_dp_rank, None if layers is None else tuple(layers),
                                   ranks(replica_group), ranks(stage_group)))
    return every


class _Relay:
    """Who receives from rank 0 and who from a peer. A replica's ranks (TP/PP peers: the same rows)
    form units (`replica_group`'s ranks), each getting the rows over its own group: rank 0 sends
    each unit's lowest rank (its leader) the buffer once, and the leader broadcasts it in the unit.
    Routes likewise per stage unit (`stage_group`: TP peers, the same rows and layers). A group
    whose ranks do not all share the rows (or layers) is not used: its ranks are units of one."""

    def __init__(self, who: list[tuple]) -> None:
        self.who = who

        def usable(idx: int, same) -> bool:
            return all(m is not None and r in m and all(same(x) == same(r) and who[x][idx] == m for x in m)
                       for r, m in ((r, w[idx]) for r, w in enumerate(who)))
        self.replicas_ok = usable(2, lambda r: who[r][0])
        self.stages_ok = usable(3, lambda r: who[r][:2])

    def replica_unit(self, r: int) -> tuple[int, ...]:
        return self.who[r][2] if self.replicas_ok else (r,)

    def stage_unit(self, r: int) -> tuple[int, ...]:
        return self.who[r][3] if self.stages_ok else (r,)

    def keys_of(self, d: int) -> list:
        """The routing layers (as tuples; None: all) the ranks of DP rank d hold."""
        return sorted({w[1] for w in self.who if w[0] == d}, key=repr)

    def units_of(self, d: int, key=..., stage: bool = False) -> list[tuple[int, ...]]:
        ranks = [r for r, w in enumerate(self.who) if w[0] == d and (key is ... or w[1] == key)]
        return sorted({(self.stage_unit if stage else self.replica_unit)(r) for r in ranks})


def scatter_rows(rank: int, make: Callable[[], tuple[TrainBatch, Any] | None], *, dp_rank: int,
                 dp_size: int, num_mini_batches: int,
                 work: Callable[[list[int]], list[float]] | None = None,
                 route_layers: list[int] | None = None, replica_group=None, stage_group=None,
                 ) -> tuple[TrainBatch, Any, dict[str, float]] | None:
    """Run `make` on rank 0 ((batch, extras) or None) and give each rank its shard of the batch
    (see the module docstring), with rank 0's `extras` and the transfer's stats:
    `bytes_per_rank` (the most any rank received) and `batch_transfer_s` (rank 0: the header,
    packing and every send; a receiver: its receives); the shard carries `dp_token_imbalance`.
    route_layers: the routing layers this rank's pipeline stage owns (None: all).
    replica_group / stage_group: groups of ranks holding the same rows (megatron's model-parallel
    group) / the same rows and routing layers (its tensor-parallel group), over which a unit's
    leader relays what rank 0 sent it (_Relay); None: rank 0 sends every rank its own. If `make`
    raises on rank 0, every rank raises (rank 0 the original error, the others DriverError), as
    on_driver does (parallel/rank_zero.py)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    key = None if route_layers is None else tuple(route_layers)
    who = _who_is_who(dp_rank, route_layers, replica_group, stage_group) if distributed \
        else [(dp_rank, key, None, None)]
    relay = _Relay(who)
    header: tuple[Any, ...] | None = None
    batch: TrainBatch | None = None
    plan, error = None, None
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
                    routes = {k: _route_manifest(batch, index, None if k is None else list(k))
                              for k in relay.keys_of(d)}
                    manifests[d] = (common, routes, [len(parts[d]) for parts in plan])
                    most = max([most] + [_nbytes(common) + _nbytes(r) for r in routes.values()])
                header = ("ok", extras, manifests, imbalance, most)
        except Exception as e:  # noqa: BLE001 - re-raised below after telling the other ranks
            error = e
            header = ("error", f"{type(e).__name__}: {e}", type(e).__name__, getattr(e, "exit_code", None))
    header = broadcast_object(header)
    if error is not None:
        raise error
    if header[0] == "error":
        raise DriverError(f"rank 0 failed: {header[1]}", header[2], header[3])
    if header[0] == "none":
        return None
    _, extras, manifests, imbalance, most_bytes = header
    common, routes, sizes = manifests[dp_rank]
    sent = [0]
    if batch is not None:  # rank 0
        mine = _send_all(batch, plan, relay, dp_size, key, replica_group, stage_group, sent)
        del batch
    else:
        t0 = time.perf_counter()
        mine = [_receive(rank, _nbytes(common), relay.replica_unit(rank), replica_group)]
        if routes.get(key):
            mine.append(_receive(rank, _nbytes(routes[key]), relay.stage_unit(rank), stage_group))
    shard = unpack(common, mine[0], sizes, imbalance)
    if routes.get(key):  # this stage's routing layers
        shard = dataclasses.replace(shard, routed_experts=_routes_view(routes[key], mine[1]),
                                    route_layers=None if key is None else list(key))
    stats = {"bytes_per_rank": float(most_bytes), "batch_transfer_s": time.perf_counter() - t0,
             "rank0_sent_bytes": float(sent[0])}  # (0 on the other ranks)
    return shard, extras, stats


def _routes_view(manifest, buffer: torch.Tensor) -> torch.Tensor:
    (_, _, dtype, shape), = manifest
    dt = getattr(torch, dtype)
    return buffer[:dt.itemsize * int(torch.Size(shape).numel())].view(dt).reshape(shape)


def _receive(rank: int, nbytes: int, unit: tuple[int, ...], group) -> torch.Tensor:
    """A buffer of `nbytes`: the unit's leader receives it from rank 0, then relays it to the unit."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=comm_device(group if len(unit) > 1 else None))
    if nbytes:  # nothing is sent for no rows
        if rank == min(unit):
            dist.recv(buffer, src=0)
        if len(unit) > 1:
            dist.broadcast(buffer, src=min(unit), group=group)
    return buffer.cpu()


def _send_all(batch: TrainBatch, plan, relay: _Relay, dp_size: int, my_key, replica_group, stage_group,
              sent: list[int]) -> list[torch.Tensor]:
    """Rank 0: pack each DP rank's rows and send them to the leader of each of its replica units,
    then each stage's routes to the leader of each of its stage units, one DP rank's buffers at a
    time (rank 0 relays to its own units as their leader); returns rank 0's own buffers."""
    mine: list[torch.Tensor] = []
    for d in range(dp_size):
        rows = [i for parts in plan for i in parts[d]]
        _, common = pack(batch, rows, routes=False)
        sent[0] += _relay_from_0(common, relay.units_of(d), replica_group)
        own = {}
        for key in relay.keys_of(d):
            _, buf = pack_routes(batch, rows, None if key is None else list(key))
            sent[0] += _relay_from_0(buf, relay.units_of(d, key, stage=True), stage_group)
            own[key] = buf
        if d == relay.who[0][0]:
            mine = [common] + ([own[my_key]] if my_key in own else [])
    return mine


def _relay_from_0(buffer: torch.Tensor, units: list[tuple[int, ...]], group) -> int:
    """Send `buffer` to each unit's leader; in rank 0's own unit, broadcast it (rank 0 leads).
    Rank 0's unit goes first: its other ranks may be leaders of stage units that wait in this
    broadcast before they take their routes from rank 0. Returns the bytes rank 0 sent."""
    if not buffer.numel():
        return 0
    sent = 0
    on_device = buffer.to(comm_device(group if any(len(u) > 1 for u in units) else None))
    for unit in sorted(units, key=lambda u: 0 not in u):
        if 0 in unit:
            if len(unit) > 1:
                dist.broadcast(on_device, src=0, group=group)
                sent += buffer.numel()
        else:
            dist.send(on_device, dst=min(unit))
            sent += buffer.numel()
    return sent
