"""One pass of an every-owner weight sync: each sender rank encodes its own buckets
(owners.stream_owned, delta.DeltaEncoder) and delivers them itself; rank 0 only coordinates
(weight_sync.py). Tensor transport: posted to every server through the project's loader
(rollout/in_server/weight_loader.py), whole or as deltas. Distributed transport: broadcast over a
weights-update group of this sender and that server alone (one per sender and server, made on
first use), whole (SGLang's own load) or as deltas (the project's loader, which broadcasts its
checksum report back over the group); nothing passes through a shared file system or shared
memory, so senders and servers may sit on different machines. Disk transport: written as the
sender's own safetensors shards of the version's folder (whole), which rank 0 indexes and has the
servers load.

    plan = PassPlan(version, targets={url: "full" | "delta"}, check_all=..., dtype="bfloat16")
    outcome = run_pass(sender_state, chunks, wmap, plan_entries, senders, bucket_bytes, plan)

Each sender posts to the servers from one thread per server, so a slow server does not hold the
others up; the servers apply each request whole and in arrival order, and nothing is served
before rank 0 sets the version and continues generation after every sender is done. A group of
its own per sender and server is what keeps the distributed transport free of deadlock: a server
takes one request at a time, and each queued request waits only on its own sender, who posted it
and is broadcasting it (one group spanning several servers would wait on all of them at once,
each of them busy with another sender's request).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.sync.delta import DeltaEncoder
from gspo_megatron.sync.owner_groups import OwnerGroups
from gspo_megatron.sync.owners import stream_owned
from rollout.in_server.weight_loader import LOADER, PART, flatten, path_tensor

# Delta syncs whose every sent tensor is checked by the servers; later ones check a sample.
CHECK_FIRST_DELTAS = 3
SAMPLE_ONE_IN = 8


@dataclass
class PassPlan:
    version: str
    targets: dict[str, str]          # url -> "full" | "delta"
    check_all: bool
    dtype: str
    keep_base: bool = True           # senders keep what they sent (delta syncs to come)
    disk_dir: str | None = None      # disk transport: the version's folder
    transport: str = "tensor"
    server_tp: dict[str, int] = field(default_factory=dict)  # distributed: each server's TP size
    regroup: list[str] = field(default_factory=list)  # distributed: servers to make a new group with
    timeout_s: float = 300.0         # distributed: a group's join and each broadcast


@dataclass
class Outcome:
    """One rank's view of the pass (gathered on rank 0)."""

    rank: int
    sent_bytes: int = 0
    buckets: int = 0
    elements: int = 0
    changed: int = 0
    checked: int = 0
    stream_s: float = 0.0   # gathering and converting this rank's tensors (and waiting for peers)
    encode_s: float = 0.0   # served dtype, deltas, checksums
    post_s: float = 0.0     # waiting for the servers to take the buckets
    error: str | None = None
    lost: list[str] = field(default_factory=list)
    mismatched: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # disk: HF name -> shard file


def _payload_bytes(payload: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for n, t in payload if not n.startswith(PART))


def sampled(name: str, version: str) -> bool:
    return zlib.crc32(f"{version}:{name}".encode()) % SAMPLE_ONE_IN == 0


class SenderState:
    """What a rank keeps between syncs: its encoder (base values), its HTTP clients and, for the
    distributed transport, its weights-update group with each server (owner_groups.py)."""

    def __init__(self) -> None:
        self.encoder: DeltaEncoder | None = None
        self.clients: dict = {}
        self.groups = OwnerGroups()

    def client(self, url: str):
        from rollout.servers.client import SGLangClient
        if url not in self.clients:
            self.clients[url] = SGLangClient(url, retries=0)
        return self.clients[url]


def run_pass(state: SenderState, chunks, wmap, plan, senders: Sequence[int], bucket_bytes: int,
             p: PassPlan) -> Outcome:
    """Every rank: stream its part, post its buckets to the servers. Never raises for a server's
    failure: it stops posting and reports it (the caller gathers the outcomes)."""
    from rollout.servers.client import ServerUnavailable
    rank = dist.get_rank()
    dtype = getattr(torch, p.dtype)
    if state.encoder is None or state.encoder.dtype != dtype or state.encoder.keep_base != p.keep_base:
        state.encoder = DeltaEncoder(dtype, keep_base=p.keep_base)
    enc = state.encoder
    enc.reset_stats()
    out = Outcome(rank)
    modes = set(p.targets.values())
    scratch = Path(tempfile.mkdtemp(prefix="gspo-sync-report-"))
    mark = [time.perf_counter()]

    def lap(phase: str) -> None:
        """The time since the last lap goes to out.<phase>."""
        now = time.perf_counter()
        setattr(out, phase, getattr(out, phase) + now - mark[0])
        mark[0] = now
    if p.transport == "distributed" and rank in set(senders):
        out.lost, out.error = state.groups.ensure(state.client, p)
    pending: dict[str, list] = {mode: [] for mode in modes}
    posts = [0]

    def post(threads) -> None:
        """Deliver what is pending (each mode's parts as one request per server), then clear it."""
        if out.error is not None or not any(pending.values()):
            return
        futures = {}
        wires = ({mode: state.groups.wire(pending[mode], mode == "delta") for mode in modes
                  if pending[mode]} if p.transport == "distributed" else {})
        for url, mode in p.targets.items():
            if not pending[mode]:
                continue  # nothing changed for this mode's servers since the last request
            if p.transport == "distributed":
                futures[url] = threads.submit(state.groups.post, state.client(url), wires[mode],
                                              p.timeout_s)
            else:
                report = scratch / f"{posts[0]}-{len(futures)}.json"
                payload = flatten(pending[mode] + [(PART + "report", path_tensor(report))])
                futures[url] = threads.submit(_post, state.client(url), payload, report)
            out.sent_bytes += _payload_bytes(pending[mode])
        posts[0] += 1
        for url, f in futures.items():
            try:
                wrong = f.result()
            except ServerUnavailable as e:
                out.error, out.lost = f"ServerUnavailable: {e}", out.lost + [url]
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                out.error = f"{type(e).__name__}: {e}"
            else:
                if wrong:
                    out.mismatched.setdefault(url, []).extend(wrong)
        for parts in pending.values():
            parts.clear()
        lap("post_s")
    try:
        with ThreadPoolExecutor(max(1, len(p.targets))) as threads:
            for i, bucket in enumerate(stream_owned(chunks, wmap, plan, senders, bucket_bytes)):
                lap("stream_s")
                if out.error is not None:
                    continue  # keep walking: the other ranks' gathers and sends need this rank
                check = [n for n, _ in bucket if p.check_all or sampled(n, p.version)]
                try:
                    parts = enc.encode(bucket, delta="delta" in modes, full="full" in modes, check=check)
                except KeyError as e:
                    out.error = f"KeyError: {e}"
                    continue
                out.buckets += 1
                lap("encode_s")
                if p.disk_dir is not None:
                    try:
                        _write_shard(p.disk_dir, rank, i, parts["full"], out)
                    except OSError as e:
                        out.error = f"{type(e).__name__}: {e}"
                    lap("post_s")
                    continue
                # A delta is a few percent of its bucket: requests of up to bucket_bytes each,
                # not one per bucket, or each server's fixed cost per request (HTTP, the
                # scheduler, the group's broadcasts) would outweigh the bytes saved.
                for mode in modes:
                    pending[mode] += parts[mode]
                if max(_payload_bytes(v) for v in pending.values()) >= bucket_bytes:
                    post(threads)
            lap("stream_s")
            post(threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out.elements, out.changed, out.checked = (enc.stats["elements"], enc.stats["changed"],
                                              enc.stats["checked"])
    if out.error is not None:
        enc.invalidate()
    return out


def _write_shard(folder: str, rank: int, i: int, payload, out: Outcome) -> None:
    """A sender's bucket as a shard of the version's folder (a file system the servers read)."""
    from safetensors.torch import save_file
    name = f"model-r{rank:05d}-{i:05d}.safetensors"
    tensors = {n: t for n, t in payload if PART not in n}
    save_file(tensors, f"{folder}/{name}", metadata={"format": "pt"})
    out.files.update({n: name for n in tensors})
    out.sent_bytes += _payload_bytes(list(tensors.items()))


def _post(client, payload, report: Path) -> list[str]:
    """One request; the loader's report: the names whose checksum differed. A loader error
    (it cannot raise, rollout/in_server/weight_loader.py) is raised here."""
    client.update_weights_from_tensor(payload, load_format=LOADER, flush_cache=False)
    try:
        got = json.loads(report.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{client.url}: the weight loader wrote no report ({e}): is "
                           f"{LOADER} registered (--custom-weight-loader)?") from None
    if got.get("error"):
        raise RuntimeError(f"{client.url}: the weight loader failed: {got['error']}")
    return list(got.get("mismatched", []))
