"""The rollout batch from rank 0 to the ranks that train it: each rank receives only its own rows,
packed without padding, as one byte buffer over the backend (NCCL on GPU, gloo on CPU).

    out = scatter_rows(rank, make, dp_rank=..., dp_size=..., num_mini_batches=4, work=work_fn)
    # None (rank 0's `make` returned None: every rank gets None), or
    # (shard, extras, stats): this rank's TrainBatch (shard(...) of the global batch, exactly),
    # rank 0's small side results (metrics), and what the transfer cost

Before (issue 29): rank 0 pickled the whole right-padded batch and broadcast it to every rank, and
each rank kept its own rows. At 1,024 rows of up to 20k tokens that was 0.41 GiB and 5 s per step
on 4 gloo ranks; with routing replay at 48 layers x top-8 it could not run at all.

Now rank 0:
1. plans the shards (balance.plan_shards: mini-batch j's rows shared by work), once;
2. packs each data-parallel rank's rows: a per-row field ([b], [b, ...]) as it is, a per-token
   field ([b, s, ...]) as its rows' real tokens concatenated ([sum of lengths, ...]); every field
   viewed as bytes, one buffer per DP rank (any dtype: bool, bf16 travel alike; routing replay's
   int16 expert ids as one byte each when the model has at most 255 experts);
3. broadcasts a small header (pickled: the metrics and each DP rank's manifest of field names,
   dtypes and shapes: O(DP x fields), not O(tokens));
4. sends each rank its DP rank's buffer (isend, one DP rank's buffer on the device at a time; the
   ranks of one replica, TP/PP/CP peers, get the same one; expert-parallel ranks are carved out
   of data parallelism and have rows of their own). A rank allocates its buffer from the manifest, receives, and unpacks it into a
   TrainBatch padded to its own longest row (the actor's layout; the padding's values are the
   rollout's: -1 for versions and routes, 0 else).

What each rank receives is its own rows' real tokens (x the per-token fields' bytes), not the step's
batch or its longest row. Not yet (issue 29's rest): rank 0 still builds the padded batch before
packing it (rollout_batch.samples_to_batch), sends every rank's buffer itself (no relay inside a
replica), and a pipeline stage still receives every layer's routes.
"""
from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.actor.balance import plan_shards, worst_imbalance
from gspo_megatron.actor.batch import TrainBatch
from gspo_megatron.parallel.comm import comm_device

# Per-token fields' values at padding positions (what samples_to_batch writes there).
PAD = {"weight_versions": -1, "routed_experts": -1}
_NOT_TENSORS = ("mini_batch_sizes", "dp_token_imbalance")
ROUTE_NONE = 255  # routed_experts on the wire: uint8, 255 = no engine routing (-1 in the batch)


def pack(batch: TrainBatch, rows: list[int]) -> tuple[list[tuple[str, str, str, tuple[int, ...]]], torch.Tensor]:
    """(manifest: (field, "row" or "token", dtype, shape) each, one uint8 buffer) of `rows` of
    `batch`: per-token fields without padding."""
    index = torch.tensor(rows, dtype=torch.long)
    global_rows = batch.global_rows if batch.global_rows is not None else torch.arange(batch.num_rows)
    lengths = batch.lengths[index]
    width = batch.tokens.shape[1]
    # The flat positions of the rows' real tokens in a [b * s] view: no padded row is copied.
    starts = index * width - torch.cumsum(lengths, 0) + lengths
    flat = torch.repeat_interleave(starts, lengths) + torch.arange(int(lengths.sum()))
    manifest, parts = [], []
    for f in fields(batch):
        t = global_rows if f.name == "global_rows" else getattr(batch, f.name)
        if t is None or f.name in _NOT_TENSORS:
            continue
        if t.dim() >= 2 and tuple(t.shape[:2]) == tuple(batch.tokens.shape):  # per token
            picked, kind = t.reshape(-1, *t.shape[2:])[flat], "token"
            if f.name == "routed_experts" and (picked.numel() == 0 or int(picked.max()) < ROUTE_NONE):
                # expert ids fit a byte (up to 255 experts): half the int16 bytes on the wire
                picked, kind = torch.where(picked < 0, ROUTE_NONE, picked).to(torch.uint8), "token_u8"
        else:
            picked, kind = t[index], "row"
        picked = picked.contiguous()
        manifest.append((f.name, kind, str(picked.dtype).removeprefix("torch."), tuple(picked.shape)))
        raw = picked.reshape(-1).view(torch.uint8)
        parts += [raw, torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8)]
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return manifest, buffer


def unpack(manifest: list, buffer: torch.Tensor, mini_batch_sizes: list[int],
           dp_token_imbalance: float) -> TrainBatch:
    """The TrainBatch of a packed buffer, padded to its longest row (see the module docstring)."""
    views, offset = {}, 0
    for name, kind, dtype, shape in manifest:
        dt = getattr(torch, dtype)
        n = dt.itemsize * int(torch.Size(shape).numel())
        views[name] = (kind, buffer[offset:offset + n].view(dt).reshape(shape))
        offset += _aligned(n)
    if offset != buffer.numel():
        raise ValueError(f"packed rows: {buffer.numel()} bytes received, the manifest accounts for {offset}")
    lengths = views["lengths"][1]
    s = max(int(lengths.max()), 1) if lengths.numel() else 1
    real = torch.arange(s)[None, :] < lengths[:, None]
    out: dict[str, Any] = {}
    for name, (kind, t) in views.items():
        if kind == "token_u8":  # routes sent as bytes: back to int16 with -1 for none
            t = torch.where(t == ROUTE_NONE, -1, t.to(torch.int16)).to(torch.int16)
            kind = "token"
        if kind == "token":
            full = torch.full((lengths.numel(), s, *t.shape[1:]), PAD.get(name, 0), dtype=t.dtype)
            full[real] = t
            out[name] = full
        else:
            out[name] = t.clone()  # own its memory (not a view of the receive buffer)
    return TrainBatch(**out, mini_batch_sizes=mini_batch_sizes, dp_token_imbalance=dp_token_imbalance)


def _aligned(nbytes: int) -> int:
    """Each field starts at a multiple of 8 bytes of the buffer (a view as int64 needs it)."""
    return -(-nbytes // 8) * 8


def _dp_rank_of_every_rank(my_dp_rank: int) -> list[int]:
    world = dist.get_world_size()
    mine = torch.tensor([my_dp_rank], dtype=torch.long, device=comm_device())
    every = [torch.zeros(1, dtype=torch.long, device=comm_device()) for _ in range(world)]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def scatter_rows(rank: int, make: Callable[[], tuple[TrainBatch, Any] | None], *, dp_rank: int,
                 dp_size: int, num_mini_batches: int,
                 work: Callable[[list[int]], list[float]] | None = None,
                 ) -> tuple[TrainBatch, Any, dict[str, float]] | None:
    """Run `make` on rank 0 ((batch, extras) or None) and give each rank its shard of the batch
    (see the module docstring), with rank 0's `extras` and the transfer's stats:
    `bytes_per_rank` (the most any rank received) and `batch_transfer_s` (rank 0: packing, the
    header and every send); the shard carries `dp_token_imbalance`. If `make` raises on rank 0, every rank raises (rank 0 the
    original error, the others driver.DriverError), as driver.on_driver."""
    from gspo_megatron.driver import DriverError, broadcast_object
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    dp_of = _dp_rank_of_every_rank(dp_rank) if distributed else [dp_rank]
    header, buffers, error = None, {}, None
    t0 = time.perf_counter()
    if rank == 0:
        try:
            got = make()
            t0 = time.perf_counter()  # the transfer: packing, the header, every send
            if got is None:
                header = ("none",)
            else:
                batch, extras = got
                lengths = batch.lengths.tolist()
                plan = plan_shards(batch.num_rows, dp_size, num_mini_batches,
                                   work(lengths) if work is not None else None)
                imbalance = worst_imbalance(lengths, plan)
                manifests = {}
                for d in range(dp_size):
                    rows = [i for parts in plan for i in parts[d]]
                    manifest, buffers[d] = pack(batch, rows)
                    manifests[d] = (manifest, [len(parts[d]) for parts in plan])
                header = ("ok", extras, manifests, imbalance,
                          max(int(b.numel()) for b in buffers.values()))
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
    manifest, sizes = manifests[dp_rank]
    if rank == 0:
        device = comm_device()
        for d, buffer in buffers.items():  # one DP rank's buffer on the device at a time
            receivers = [r for r in range(1, len(dp_of)) if dp_of[r] == d] if distributed else []
            if receivers and buffer.numel():
                on_device = buffer.to(device)
                for s in [dist.isend(on_device, dst=r) for r in receivers]:
                    s.wait()
                del on_device
        mine = buffers[dp_rank]
    else:
        t0 = time.perf_counter()
        nbytes = sum(_aligned(getattr(torch, dt).itemsize * int(torch.Size(shape).numel()))
                     for _, _, dt, shape in manifest)
        mine = torch.empty(nbytes, dtype=torch.uint8, device=comm_device())
        if nbytes:  # rank 0 sends nothing for no rows
            dist.recv(mine, src=0)
        mine = mine.cpu()
    shard = unpack(manifest, mine, sizes, imbalance)
    stats = {"bytes_per_rank": float(most_bytes), "batch_transfer_s": time.perf_counter() - t0}
    return shard, extras, stats

