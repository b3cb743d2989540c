"""The project's SGLang weight loader (registered with `--custom-weight-loader`, chosen per
/update_weights_from_tensor request by `load_format=LOADER`): applies the trainer's weight
deltas, verifies checksums, and reads the served weights back in HF layout.

Where each HF element lives on this server (a delta is a few elements of an HF tensor) is
rollout/in_server/placement.py's probe.

The payload is a list of (name, tensor) pairs, several per HF tensor `N` (PART separates):
    N                  the whole tensor (a dense update: loaded by the model's own load_weights)
    N|idx, N|val       flat indices (int32/int64) and their new values: a sparse update
    N|bits, N|val      the same with a bitmask of the changed elements (pack_bits) for indices
    N|shape            int64 [ndim]: N's shape (sparse updates and checks)
    N|sum              int64 [1]: checksum(N) as the trainer computed it: verified after applying
    |export            uint8 path: write the listed names' served values (N|shape entries) there
    |report            uint8 path: write what happened there, as JSON (load's docstring)
    |reply=G           uint8 [1]: broadcast the report over the weights-update group named G
    |lora              uint8 name: the whole tensors are LoRA adapter NAME's, in PEFT's names,
                       written in place into the server's LoRA state (lora_state.py); their N|sum
                       checksums are checked on what arrived
    |flat=[[n, dtype, shape, offset], ...]   uint8: the entries above as one buffer (flatten():
                       the tensor transport shares one tensor per request, not hundreds)
Nothing here may raise: SGLang calls a custom loader outside any try
(WeightUpdater.update_weights_from_tensor), so an exception kills the scheduler. Errors and
checksum mismatches go to the report instead: a file for the tensor transport (it runs on the
servers' machine, so the sender reads it after the call), a broadcast back to the sender for the
distributed one. The trainer counts a mismatch and sends that server a full sync.

The distributed transport has no custom-loader hook in SGLang: /update_weights_from_distributed
receives the tensors and hands them to `model.load_weights` (model_runner_components/
weight_updater.py WeightUpdater.load_weights_from_distributed). So the first call of this loader
(every sync ends with one, the version's) routes the model's load_weights (`route_load_weights`):
a list with a PART name is this loader's payload, anything else goes to the model's own
load_weights untouched.
"""
from __future__ import annotations

import json
import logging
import math
import os
import traceback
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch

from rollout.in_server.placement import (NotPositional, Placement, apply_sparse, own_load_weights, probe,
                                      served_values)

LOADER = "rollout.in_server.weight_loader.load"
PART = "|"
REPLY = PART + "reply="  # + the group's name
_MOD = (1 << 31) - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of the same width, flat: equal exactly when the
    elements are bit-identical (-0.0 and NaN payloads included)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


# checksum(): a tensor's 16-bit words (8-bit for 1-byte dtypes) as rows of _ROW, each row a
# float64 dot product with position weights in 1..65521: every partial sum is an integer below
# 2**44, so float64 holds it exactly and the result does not depend on the device, the BLAS or
# the order of summation; the rows are then folded mod 2**31 - 1 with their own weights. About 3
# passes over the bytes instead of 12 of int64 arithmetic: 5 ms for 16 M bf16 elements on one CPU
# core against 490 ms, where it was most of a sampled delta sync's time on the server.
_ROW = 4096


def _weights(n: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return (i * 40503 + 17) % 65521 + 1  # distinct for i < 65521: 40503 is invertible mod 65521


def checksum(values: torch.Tensor, rows_per_chunk: int | None = None) -> int:
    """A position-weighted sum of the tensor's bit patterns, mod 2**31 - 1: equal on the trainer
    and on the server only when every element is bit-identical (to the odds of a 31-bit hash; a
    single changed element always shows, as does a swap of two within a row). The order of the
    flat elements is the tensor's. rows_per_chunk: how many rows are converted at once (a cache-
    sized buffer on CPU, larger on GPU); it does not change the result."""
    v = values.detach().reshape(-1)
    words = v.view(torch.int8 if v.element_size() == 1 else torch.int16)
    n, device = words.numel(), words.device
    full = n // _ROW
    chunk = rows_per_chunk or (64 if device.type == "cpu" else 4096)
    col = _weights(_ROW, device).to(torch.float64)
    buf = torch.empty(min(chunk, max(full, 1)), _ROW, dtype=torch.float64, device=device)
    sums = []
    for r in range(0, full, chunk):
        k = min(chunk, full - r)
        b = buf[:k]
        b.copy_(words[r * _ROW:(r + k) * _ROW].view(k, _ROW))
        sums.append(b @ col)
    if n > full * _ROW:
        tail = torch.zeros(_ROW, dtype=torch.float64, device=device)
        tail[:n - full * _ROW] = words[full * _ROW:]
        sums.append((tail @ col).reshape(1))
    if not sums:
        return 0
    rows = torch.cat(sums).to(torch.int64) % _MOD
    return int(((rows * _weights(rows.numel(), device)) % _MOD).sum().item() % _MOD)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as uint8, 8 elements a byte, element 8*i + j in bit j of byte i."""
    m = mask.reshape(-1)
    pad = (-m.numel()) % 8
    if pad:
        m = torch.cat([m, m.new_zeros(pad)])
    # in uint8 throughout: 5x faster than int32 arithmetic on a CPU (7 ms for 4 M elements)
    shifts = torch.arange(8, dtype=torch.uint8, device=m.device)
    return (m.view(torch.uint8).view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat indices of the set bits of pack_bits' output."""
    bits = (packed.view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(-1)[:numel].nonzero().reshape(-1)


def _tp_rank_and_size() -> tuple[int, int]:
    """This server rank's place in its TP group."""
    try:
        from sglang.srt.distributed import (get_tensor_model_parallel_rank,
                                            get_tensor_model_parallel_world_size)
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - outside an SGLang server (tests): one rank
        return 0, 1


def _group(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    entries: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    order: list[str] = []
    for name, t in named:
        base, _, part = name.rpartition(PART) if PART in name else (name, "", "dense")
        if base not in entries:
            order.append(base)
        entries[base][part] = t
    return entries, order


def _path(t: torch.Tensor | None) -> str | None:
    return None if t is None else bytes(t.to(torch.uint8).tolist()).decode()


FLAT = PART + "flat="


def flatten(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A payload as one (name, uint8 tensor) pair: each entry's name, dtype, shape and byte offset
    in the name (JSON), the bytes concatenated, each entry at a multiple of 8 (for its view). The
    buffer is on the GPU where any entry is (the small host entries, paths and shapes, join it
    there: one CUDA IPC handle per request), else on the host."""
    device = next((t.device for _, t in named if t.device.type != "cpu"), torch.device("cpu"))
    meta, chunks, offset = [], [], 0
    for name, t in named:
        pad = (-offset) % 8
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            offset += pad
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        meta.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        chunks.append(data)
        offset += data.numel()
    buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return [(FLAT + json.dumps(meta), buf)]


def unflatten(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """flatten()'s entries back (views of the buffer); other entries as they are."""
    out = []
    for name, t in named:
        if not name.startswith(FLAT):
            out.append((name, t))
            continue
        for entry, dtype, shape, offset in json.loads(name[len(FLAT):]):
            dt = getattr(torch, dtype)
            size = math.prod(shape) * dt.itemsize
            out.append((entry, t[offset:offset + size].view(dt).reshape(shape)))
    return out


def path_tensor(path: str) -> torch.Tensor:
    """A file path as the payload carries it (|export, |report)."""
    return torch.tensor(list(str(path).encode()), dtype=torch.uint8)


def route_load_weights(model: torch.nn.Module) -> None:
    """Make `model.load_weights` hand this loader's payloads (a list with a PART name) to load();
    idempotent. The model's own load_weights stays at `model.gspo_own_load_weights`."""
    if getattr(model, "gspo_own_load_weights", None) is not None:
        return
    # SGLang's model classes define load_weights (SGLang ships no types; torch's Module types an
    # attribute as a tensor or a module): read and replace it as the attribute it is on the instance
    own: Callable[[Any], Any] = getattr(model, "load_weights")

    def load_weights(weights: Any) -> Any:
        if isinstance(weights, list) and any(PART in n for n, _ in weights):
            return load(model, weights)
        return own(weights)  # HF names, or the disk loader's iterator (not consumed here)
    setattr(model, "gspo_own_load_weights", own)
    setattr(model, "load_weights", load_weights)


def load(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The custom weight loader (module docstring). Called by SGLang on every TP rank; writes
    {"mismatched": [names], "unchecked": n, "checked": n, "error": str | None} to |report (rank 0)
    or broadcasts it over the |reply= group (from TP rank 0, group rank 1)."""
    route_load_weights(model)
    entries, order = _group(unflatten(named_tensors))
    meta = entries.pop("", {})
    report = {"mismatched": [], "checked": 0, "unchecked": 0, "error": None}
    try:
        _load(model, entries, [n for n in order if n != ""], _path(meta.get("export")), report,
              _path(meta.get("lora")))
    except Exception as e:  # noqa: BLE001 - reported, never raised (module docstring)
        report["error"] = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).error("gspo weight loader: %s", traceback.format_exc())
    path = _path(meta.get("report"))
    if path is not None and _tp_rank_and_size()[0] == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
    key = REPLY.removeprefix(PART)  # "|reply=G" groups as the meta entry "reply=G"
    group = next((k.removeprefix(key) for k in meta if k.startswith(key)), None)
    if group is not None:
        try:
            _reply(group, report)
        except Exception:  # noqa: BLE001 - the sender's wait fails (bounded), naming no report
            logging.getLogger(__name__).error("gspo weight loader reply: %s", traceback.format_exc())


def _reply(group_name: str, report: dict) -> None:
    """The report, broadcast from group rank 1 (this server's TP rank 0) over the named
    weights-update group: its length, then its JSON bytes. Every server rank of the group joins."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    pg = next((g for g, n in _world.pg_names.items() if n == group_name), None)
    if pg is None:
        raise LookupError(f"no weights-update group named {group_name!r} on this server")
    # pg_map holds each group's backend by name (the group is outside torch's default world)
    device = (torch.device("cuda", torch.cuda.current_device()) if _world.pg_map[pg][0] == "nccl"
              else torch.device("cpu"))
    data = torch.tensor(list(json.dumps(report).encode()), dtype=torch.uint8, device=device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(n, group_src=1, group=pg)
    if pg.rank() != 1:
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, group_src=1, group=pg)


@torch.no_grad()
def _load(model: torch.nn.Module, entries: dict[str, dict[str, torch.Tensor]], order: list[str],
          export: str | None, report: dict, lora: str | None = None) -> None:
    dense = [(n, entries[n]["dense"]) for n in order if "dense" in entries[n]]
    if lora is not None:
        _load_adapter(lora, entries, dense, report)
        return
    if dense:
        own_load_weights(model)(dense)
    shapes: dict[str, Sequence[int]] = {n: [int(x) for x in e["shape"].tolist()] for n, e in entries.items()
                                        if "shape" in e}
    places = probe(model, shapes) if shapes else {}
    params = dict(model.named_parameters())
    for n in order:
        e = entries[n]
        if "idx" in e:
            apply_sparse(places[n], params, e["idx"], e["val"])
        elif "bits" in e:
            apply_sparse(places[n], params, unpack_bits(e["bits"], places[n].numel), e["val"])
    if places:
        # The probe went through load_weights, which may derive tensors from what it loaded
        # (DeepSeek's w_kc / w_vc from kv_b_proj); the sparse writes bypass it: derive them again
        # from the parameters as they are now.
        _post_load_weights(model)
    for n in order:
        e = entries[n]
        if "sum" not in e:
            continue
        idx, vals = served_values(places[n], params)
        if idx.numel() != places[n].numel:
            if _tp_rank_and_size()[1] == 1:
                raise NotPositional(f"{n}: the server holds {idx.numel()} of its "
                                    f"{places[n].numel} elements after loading")
            report["unchecked"] += 1  # a TP shard: not checkable on this rank alone
            continue
        report["checked"] += 1
        # idx is sorted and unique (served_values): holding every element, vals is the tensor
        if checksum(vals) != int(e["sum"].reshape(-1)[0]):
            report["mismatched"].append(n)
    if export is not None and _tp_rank_and_size()[0] == 0:
        _export(export, shapes, places, params)


def _load_adapter(name: str, entries: dict[str, dict[str, torch.Tensor]],
                  dense: list[tuple[str, torch.Tensor]], report: dict) -> None:
    """A LoRA adapter's new version (|lora): the checksums of what arrived, then the write."""
    from rollout.in_server.lora_state import write_adapter
    for n, t in dense:
        if "sum" in entries[n]:
            report["checked"] += 1
            if checksum(t) != int(entries[n]["sum"].reshape(-1)[0]):
                report["mismatched"].append(n)
    if report["mismatched"]:
        return  # nothing written: the sender sends the version again
    report["mismatched"] += write_adapter(name, dict(dense))
def _post_load_weights(model: torch.nn.Module) -> None:
    """SGLang's post_load_weights (sglang 0.5.23 model_loader/loader.py): the model's own, where it
    has one. Outside an SGLang server (a process standing in for one: tools/gpu_check_sync.py on a
    GPU machine without SGLang) the same, done here."""
    try:
        from sglang.srt.model_loader.loader import post_load_weights
    except ImportError:
        post_load = getattr(model, "post_load_weights", None)
        if callable(post_load):
            post_load()
        return
    post_load_weights(model)


def _export(path: str, shapes: dict[str, Sequence[int]], places: dict[str, Placement],
            params: dict[str, torch.nn.Parameter]) -> None:
    """The served values of `shapes`' tensors in HF layout, as safetensors (tests compare them
    with the trainer's tensors bit for bit). Elements this rank does not hold are NaN."""
    from safetensors.torch import save_file
    out = {}
    for n, shape in shapes.items():
        idx, vals = served_values(places[n], params)
        full = torch.full((math.prod(shape),), math.nan, dtype=vals.dtype if vals.numel() else torch.float32)
        full[idx.cpu()] = vals.cpu()
        out[n] = full.reshape(tuple(shape))
    save_file(out, path)
