"""One pass of a weight sync on one rank: stream its own buckets (stream.stream_owned), encode them
for the servers (delta.DeltaEncoder: whole, or only the changed elements), and hand the pending
parts to the pass's Sender (transports.py), which delivers them; rank 0 only coordinates
(weight_sync.py).

    plan = PassPlan(version, targets={url: "full" | "delta"}, check_all=..., dtype="bfloat16",
                    keep_base=True, sender=transport.sender(version, targets))      # rank 0
    outcome = run_pass(state, encoder, chunks, wmap, entries, senders, bucket_bytes, plan)  # every rank

Pending parts go out once they reach bucket_bytes in one mode: a delta is a few percent of its
bucket, so deltas travel in requests of up to bucket_bytes each, not one per bucket, or each
server's fixed cost per request (HTTP, the scheduler, a group's broadcasts) would outweigh the
bytes saved. Each request goes to every server of its mode from a thread per server, so a slow
server does not hold the others up; the servers apply each request whole and in arrival order,
and nothing is served before rank 0 sets the version and continues generation after every sender
is done. A server's failure never raises here: the pass stops posting, walks the stream to its
end (the other ranks' gathers and sends need this rank) and reports it in its Outcome.
"""
from __future__ import annotations

import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.sync.delta import DeltaEncoder
from gspo_megatron.sync.stream import stream_owned
from gspo_megatron.sync.transport_base import Parts, Sender, SenderState
from rollout.in_server.weight_loader import PART

if TYPE_CHECKING:
    from gspo_megatron.sync.stream import PlanEntry
    from model_specs.weights.maps import WeightMap

# Delta syncs whose every sent tensor is checked by the servers; later ones check a sample.
CHECK_FIRST_DELTAS = 3
SAMPLE_ONE_IN = 8


@dataclass
class PassPlan:
    """Rank 0 -> every rank: what this pass sends, to whom, and how."""

    version: str
    targets: dict[str, str]          # url -> "full" | "delta"
    check_all: bool                  # deltas: every tensor checksummed (else a sample)
    dtype: str                       # the servers' dtype: what goes on the wire
    keep_base: bool                  # senders keep what they sent (delta syncs to come)
    sender: Sender                   # what every sender does with its parts (Transport.sender)


@dataclass
class Outcome:
    """Every rank -> rank 0: its view of the pass."""

    rank: int
    sent_bytes: int = 0     # to every server: a request's bytes once per server of its mode
    buckets: int = 0
    elements: int = 0
    changed: int = 0        # elements that differ from the base (delta passes)
    checked: int = 0
    stream_s: float = 0.0   # gathering and converting this rank's tensors (and waiting for peers)
    encode_s: float = 0.0   # served dtype, deltas, checksums
    post_s: float = 0.0     # packing, and waiting for the servers to take the requests
    error: str | None = None
    lost: list[str] = field(default_factory=list)
    mismatched: dict[str, list[str]] = field(default_factory=dict)


def payload_bytes(parts: Parts) -> int:
    return sum(t.numel() * t.element_size() for n, t in parts if not n.startswith(PART))


def sampled(name: str, version: str) -> bool:
    return zlib.crc32(f"{version}:{name}".encode()) % SAMPLE_ONE_IN == 0


def run_pass(state: SenderState, encoder: DeltaEncoder | None, chunks: Sequence[torch.nn.Module],
             wmap: WeightMap, entries: Sequence[PlanEntry], senders: Sequence[int], bucket_bytes: int,
             plan: PassPlan) -> tuple[Outcome, DeltaEncoder]:
    """Every rank (module docstring); never raises for a server's or the transport's failure.
    `encoder`: the one of the rank's previous pass (its base), None on the first; returns the
    outcome and the encoder to keep."""
    sender_pass = SenderPass(state, encoder, plan)
    return sender_pass.run(chunks, wmap, entries, senders, bucket_bytes), sender_pass.enc


class SenderPass:
    def __init__(self, state: SenderState, encoder: DeltaEncoder | None, plan: PassPlan) -> None:
        self.state, self.plan, self.sender = state, plan, plan.sender
        dtype = getattr(torch, plan.dtype)
        if encoder is None or encoder.dtype != dtype or encoder.keep_base != plan.keep_base:
            encoder = DeltaEncoder(dtype, keep_base=plan.keep_base)
        encoder.reset_stats()
        encoder.on_device = self.sender.keeps_device()
        self.enc = encoder
        self.out = Outcome(dist.get_rank())
        self.modes = sorted(set(plan.targets.values()))
        self.pending: dict[str, list[tuple[str, torch.Tensor]]] = {mode: [] for mode in self.modes}
        self.mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last lap goes to out.<phase>."""
        now = time.perf_counter()
        setattr(self.out, phase, getattr(self.out, phase) + now - self.mark)
        self.mark = now

    def fail(self, url: str | None, e: BaseException) -> None:
        """A server lost (ServerUnavailable from a post to `url`), or another failure: the pass's
        first error is what rank 0 reports."""
        from rollout.servers.client import ServerUnavailable
        if url is not None and isinstance(e, ServerUnavailable):
            self.out.lost.append(url)
        if self.out.error is None:
            self.out.error = f"{type(e).__name__}: {e}"

    def run(self, chunks: Sequence[torch.nn.Module], wmap: WeightMap, entries: Sequence[PlanEntry],
            senders: Sequence[int], bucket_bytes: int) -> Outcome:
        enc, p = self.enc, self.plan
        sending = self.out.rank in set(senders)
        if sending:
            try:
                for url, e in self.sender.open(self.state, dict(p.targets)).items():
                    self.fail(url, e)
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                self.fail(None, e)
        try:
            with ThreadPoolExecutor(max(1, len(p.targets))) as threads:
                for bucket in stream_owned(chunks, wmap, entries, senders, bucket_bytes):
                    self.lap("stream_s")
                    if self.out.error is not None:
                        continue  # keep walking: the other ranks' gathers and sends need this rank
                    check = [n for n, _ in bucket if p.check_all or sampled(n, p.version)]
                    try:
                        parts = enc.encode(bucket, delta="delta" in self.modes, full="full" in self.modes,
                                           check=check)
                    except KeyError as e:
                        self.fail(None, e)
                        continue
                    self.out.buckets += 1
                    self.lap("encode_s")
                    for mode in self.modes:
                        self.pending[mode] += parts[mode]
                    if max(payload_bytes(v) for v in self.pending.values()) >= bucket_bytes:
                        self.post(threads)
                self.lap("stream_s")
                self.post(threads)
        finally:
            if sending:
                try:
                    self.sender.close(self.state)
                except Exception as e:  # noqa: BLE001 - reported to rank 0
                    self.fail(None, e)
        self.out.elements, self.out.changed, self.out.checked = (
            enc.stats["elements"], enc.stats["changed"], enc.stats["checked"])
        if self.out.error is not None:
            enc.invalidate()
        return self.out

    def post(self, threads: ThreadPoolExecutor) -> None:
        """Deliver what is pending: each mode's parts packed once and posted to every server of
        that mode, each from a thread of its own; then clear it."""
        if self.out.error is None and any(self.pending.values()):
            try:
                packed = {mode: self.sender.pack(self.state, mode, parts)
                          for mode, parts in self.pending.items() if parts}
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                self.fail(None, e)
                packed = {}
            futures = {url: threads.submit(self.sender.post, self.state, url, packed[mode])
                       for url, mode in self.plan.targets.items() if mode in packed}
            for url, f in futures.items():
                self.out.sent_bytes += payload_bytes(self.pending[self.plan.targets[url]])
                try:
                    wrong = f.result()
                except Exception as e:  # noqa: BLE001 - reported to rank 0
                    self.fail(url, e)
                else:
                    if wrong:
                        self.out.mismatched.setdefault(url, []).extend(wrong)
        for parts in self.pending.values():
            parts.clear()
        self.lap("post_s")
