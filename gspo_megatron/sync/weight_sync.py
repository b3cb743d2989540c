"""Push the trainer's weights into the SGLang servers after an optimizer step.

    sync = WeightSync(chunks, hf_config, transport=TensorTransport(pool), pool=pool)  # every rank
    report = sync.sync(version=step)     # collective; pool/transport are used on rank 0 only

One sync, whatever the transport (transports.py): rank 0 pauses generation on every server
(running requests are retracted and re-run with the new weights) and begins the transport
(sessions, a folder); every sender (each owner of full tensors, or rank 0 alone with
senders="rank0") sends its own buckets, whole or as deltas (sender_pass.py); rank 0 judges the
senders' outcomes, has the transport set the new version, checks that every server reports it,
and continues generation. The messages between the ranks are dataclasses: PassStart (rank 0 ->
all), Outcome (all -> rank 0), Verdict (rank 0 -> all).

The servers are the pool's live and rejoining ones (rollout/servers/health.py): a server that came
back after a failure gets the weights whole here and serves only after its version checked out.
A server lost part-way is taken out, and since the servers still there may hold part of the new
weights the whole sync runs again (every rank streams again, whole) on the servers there are, at
most once per server. A checksum mismatch after a delta gets that server a full pass in the same
sync (once). No server left to take the weights: WeightSyncError(no_server=True), and the trainer
waits for one (run/recovery.py). If anything else fails, the transport undoes what would stop the
next sync (Transport.abort: a half-written folder goes), the servers are LEFT PAUSED (they may hold
a mix of old and new weights, so they must not generate), `stale` is set, and every rank raises
WeightSyncError (exit 3); the next successful sync, whole to every server, un-pauses them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from gspo_errors import GspoError
from gspo_megatron.sync.delta import DeltaEncoder
from gspo_megatron.sync.sender_pass import CHECK_FIRST_DELTAS, Outcome, PassPlan, run_pass
from gspo_megatron.sync.stream import PlanEntry, assign_senders, build_plan
from gspo_megatron.sync.transport_base import SenderState, Transport
from gspo_megatron.sync.transports import TRANSPORTS
from model_specs.weights.maps import weight_map_for

if TYPE_CHECKING:
    from rollout.servers.pool import ServerPool

_Message = TypeVar("_Message")


class WeightSyncError(GspoError, RuntimeError):
    """A sync that did not complete; the servers are paused and marked stale. no_server: because
    no server was left to take it (rollout/servers/health.py; the trainer waits for one)."""

    def __init__(self, message: str, no_server: bool = False) -> None:
        super().__init__(message)
        self.no_server = no_server


def _in_chain(error: BaseException | None, types: tuple[type[BaseException], ...]) -> bool:
    while error is not None:
        if isinstance(error, types):
            return True
        error = error.__cause__ or error.__context__
    return False


def _no_server(error: BaseException) -> bool:
    from rollout.servers.errors import NoServerLeft
    return _in_chain(error, (NoServerLeft,))


def _from_rank0(message: _Message | None) -> _Message:
    """Rank 0's message on every rank (rank 0 passes it, the others None)."""
    got = [message]
    dist.broadcast_object_list(got, src=0)
    if got[0] is None:
        raise RuntimeError("rank 0 broadcast no message")
    return got[0]


@dataclass
class PassStart:
    """Rank 0 -> every rank: the pass to run, or why there is none."""

    plan: PassPlan | None
    error: str | None = None
    no_server: bool = False


@dataclass
class Verdict:
    """Rank 0 -> every rank, after a pass."""

    error: str | None = None
    repair: list[str] = field(default_factory=list)  # servers that get a full pass in this sync
    retry: bool = False                              # a server was lost: the whole sync again
    no_server: bool = False                          # none left to take it


@dataclass
class Totals:
    """Rank 0: what the passes of one sync sent (its report)."""

    bytes: int = 0
    rank0_bytes: int = 0
    buckets: int = 0
    senders: set[int] = field(default_factory=set)
    full: int = 0
    mismatches: int = 0
    repaired: bool = False
    # the changed fraction is the last attempt's first pass's: the one that decided every server's
    # new values (a repair resends what that pass sent as a delta)
    elements: int = 0
    changed: int = 0
    measured: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("stream_s", "encode_s", "post_s"), 0.0))

    def add(self, plan: PassPlan, outcomes: Sequence[Outcome], first: bool) -> None:
        for o in outcomes:
            if o.sent_bytes:
                self.senders.add(o.rank)
            self.bytes += o.sent_bytes
            self.rank0_bytes += o.sent_bytes if o.rank == 0 else 0
            self.buckets += o.buckets
            self.mismatches += sum(len(v) for v in o.mismatched.values())
            for k in self.seconds:  # the slowest sender's
                self.seconds[k] = max(self.seconds[k], getattr(o, k))
        self.full += sum(m == "full" for m in plan.targets.values())
        if first:
            self.elements = sum(o.elements for o in outcomes)
            self.changed = sum(o.changed for o in outcomes)
            self.measured = "delta" in plan.targets.values()

    def report(self, seconds: float, attempts: int) -> dict[str, float]:
        """What every sync reports, meaning the same on every transport: bytes to every server
        (a request's bytes once per server it is for), changed_fraction measured against the
        senders' bases on a delta sync and 1 on a whole one."""
        return {"seconds": seconds, "bytes": float(self.bytes), "buckets": float(self.buckets),
                "gb_per_s": self.bytes / seconds / 1e9 if seconds > 0 else 0.0,
                "attempts": float(attempts), "rank0_bytes": float(self.rank0_bytes),
                "senders": float(len(self.senders)),
                "changed_fraction": self.changed / max(1, self.elements) if self.measured else 1.0,
                "full_syncs": float(self.full), "checksum_mismatches": float(self.mismatches),
                "stream_seconds": self.seconds["stream_s"], "encode_seconds": self.seconds["encode_s"],
                "post_seconds": self.seconds["post_s"]}


class WeightSync:
    """Weight sync of one trainer job (construct on every rank; `transport` and `pool` are only
    used on global rank 0 and may be None elsewhere). senders: "owners" (every owner of full
    tensors sends its own) or "rank0" (the owners hand them to rank 0, which sends them all).
    delta: None, deltas where the transport can carry them (TRANSPORTS); True, the same, refused
    with a transport that cannot; False, whole tensors every time."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hf_config: Mapping[str, Any],
                 transport: Transport | None, pool: ServerPool | None = None, *,
                 bucket_bytes: int = 256 << 20, pause_mode: str = "retract", senders: str = "owners",
                 delta: bool | None = None) -> None:
        if senders not in ("owners", "rank0"):
            raise ValueError(f"senders={senders!r}: expected 'owners' or 'rank0'")
        self.chunks, self.hf_config = list(chunks), dict(hf_config)
        self.wmap = weight_map_for(hf_config)
        self.transport, self.pool, self.senders = transport, pool, senders
        self.bucket_bytes, self.pause_mode = bucket_bytes, pause_mode
        self.rank = dist.get_rank()
        self.deltas = False  # rank 0: whether this sync sends deltas
        if self.rank == 0:
            if transport is None or pool is None:
                raise ValueError("WeightSync on rank 0 needs a transport and the server pool")
            row = transport.row or TRANSPORTS.get(transport.name)
            if row is None:
                raise ValueError(f"transport {transport.name!r}: not a row of TRANSPORTS "
                                 f"({', '.join(TRANSPORTS)})")
            if delta and not row.deltas:
                raise ValueError(f"delta=True: the {row.name} transport carries whole tensors only")
            self.deltas = row.deltas and delta is not False
        self.state = SenderState()
        self.encoder: DeltaEncoder | None = None  # this rank's, with the base of its last pass
        self._plan: list[PlanEntry] | None = None
        self._sender_of: list[int] = []
        self._delta_ready = False  # the servers in sync hold what the encoders' bases say
        self._deltas_sent = 0
        self._served_dtype: str | None = None
        self.version: str | None = None  # the version the servers serve, as far as we know
        self.stale = False               # True after a failed sync: servers paused, weights mixed

    def sync(self, version: str | int, again: bool = False) -> dict[str, float]:
        """Collective. Returns the sync's report (Totals.report; rank 0's view on rank 0). again:
        the version the servers already serve, for servers that came back (rollout/servers/health.py)."""
        version = str(version)
        if version == self.version and not again:
            raise ValueError(f"weight version {version!r} is what the servers already serve; "
                             "every sync needs a new version")
        if self._plan is None:
            self._plan = build_plan(self.chunks, self.wmap)
            self._sender_of = assign_senders(self._plan, only=0 if self.senders == "rank0" else None)
        start = time.perf_counter()
        totals, attempt, repair = Totals(), 0, list[str]()
        while True:
            attempt += 1  # every pass, repairs included
            begun = _from_rank0(self._begin(version, repair) if self.rank == 0 else None)
            outcomes: list = [None] * dist.get_world_size()
            if begun.plan is not None:
                mine, self.encoder = run_pass(self.state, self.encoder, self.chunks, self.wmap, self._plan,
                                              self._sender_of, self.bucket_bytes, begun.plan)
                dist.all_gather_object(outcomes, mine)
            verdict = _from_rank0(self._judge(version, begun, outcomes, totals, attempt, first=not repair)
                                  if self.rank == 0 else None)
            if verdict.error is not None:
                if self.encoder is not None:  # some server may hold part of this version
                    self.encoder.invalidate()
                self._delta_ready = False
                if verdict.retry:
                    repair = []
                    continue
                self.stale = True
                raise WeightSyncError(f"weight sync to version {version} failed: {verdict.error}. The "
                                      "servers are left paused and may hold a mix of old and new "
                                      "weights; sync again before generating.", no_server=verdict.no_server)
            if not verdict.repair:
                break
            repair = verdict.repair
        self.stale, self.version, self._delta_ready = False, version, True
        if begun.plan is not None and "delta" in begun.plan.targets.values():
            self._deltas_sent += 1
        return totals.report(time.perf_counter() - start, attempt)

    @property
    def _pool(self) -> ServerPool:
        """Rank 0's server pool (the other ranks hold None and never ask)."""
        if self.pool is None:
            raise RuntimeError(f"rank {self.rank}: only rank 0's WeightSync talks to the servers")
        return self.pool

    @property
    def _transport(self) -> Transport:
        """Rank 0's transport (the other ranks hold None and never ask)."""
        if self.transport is None:
            raise RuntimeError(f"rank {self.rank}: only rank 0's WeightSync runs the transport")
        return self.transport

    def _served(self) -> str:
        """The servers' dtype (rank 0): their launch argument, else the model config's."""
        if self._served_dtype is None:
            got = {c.served_dtype() for c in self._pool.sync_clients()}
            got = {self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
                   if d == "auto" else d for d in got}
            if len(got) != 1:
                raise WeightSyncError(f"the servers serve different dtypes {sorted(got)}: one sync "
                                      "cannot be bit-exact for all of them")
            self._served_dtype = str(got.pop()).removeprefix("torch.")
        return self._served_dtype

    def _targets(self, repair: list[str]) -> dict[str, str]:
        """Rank 0: which servers get this pass, and how: a delta where the server is live and
        reports the version every encoder's base holds, else the full weights."""
        from rollout.servers.health import LIVE
        if repair:
            return {u: "full" for u in repair}
        clients = self._pool.sync_clients()
        if not clients:
            from rollout.servers.errors import NoServerLeft
            raise NoServerLeft(", ".join(self._pool.server_urls),
                               f"no server is left to take the weights ({self._pool.summary()})")
        delta = self.deltas and self._delta_ready
        versions = self._pool.weight_versions() if delta else {}
        return {c.url: "delta" if (delta and self._pool.status(c.url) == LIVE
                                   and versions.get(c.url) == self.version) else "full"
                for c in clients}

    def _begin(self, version: str, repair: list[str]) -> PassStart:
        """Rank 0: pause the servers and begin the transport (not again for a repair), then the
        pass plan."""
        try:
            if not repair:
                self._pool.pause_generation(self.pause_mode)
                self._transport.begin(version)
            targets = self._targets(repair)  # after the pause and begin: a server they took out is no target
            return PassStart(PassPlan(version, targets, check_all=self._deltas_sent < CHECK_FIRST_DELTAS,
                                      dtype=self._served(), keep_base=self.deltas,
                                      sender=self._transport.sender(version, targets)))
        except Exception as e:  # noqa: BLE001 - reported on every rank
            return PassStart(None, f"{type(e).__name__}: {e}", _no_server(e))

    def _judge(self, version: str, begun: PassStart, outcomes: Sequence[Outcome], totals: Totals,
               attempt: int, first: bool) -> Verdict:
        """Rank 0, after a pass (module docstring): retry, repair, fail, or finish."""
        if begun.plan is None:
            self._abort(version)
            return Verdict(begun.error, no_server=begun.no_server)
        totals.add(begun.plan, outcomes, first)
        failed = [o for o in outcomes if o.error is not None]
        lost = sorted({u for o in outcomes for u in o.lost})
        if failed:
            error = f"rank {failed[0].rank}: {failed[0].error}"
            for url in lost:
                self._pool.take_out(url, f"lost during a weight sync: {error}")
            self._abort(version)
            left = bool(self._pool.sync_clients())
            return Verdict(error, retry=bool(lost) and left and attempt <= len(self._pool.clients),
                           no_server=not left)
        wrong = sorted({u for o in outcomes for u in o.mismatched})
        if wrong:
            if totals.repaired:
                return Verdict(f"servers {wrong} still differ from the trainer after a full sync "
                               f"({totals.mismatches} tensors)")
            totals.repaired = True
            return Verdict(repair=wrong)
        try:
            self._finish(version)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            self._abort(version)
            return Verdict(f"{type(e).__name__}: {e}", no_server=_no_server(e))
        return Verdict()

    def _finish(self, version: str) -> None:
        self._transport.finish(version)
        served = self._pool.weight_versions()  # of the servers still in the sync
        wrong = {url: v for url, v in served.items() if v != version}
        if wrong:
            raise WeightSyncError(f"servers report weight versions {wrong} after the update, "
                                  f"expected {version!r}")
        if not served:
            raise WeightSyncError(f"no server is left to take version {version!r} "
                                  f"({self._pool.summary()})")
        self._pool.synced(version)  # servers that came back hold the policy now: they serve again
        self._pool.continue_generation()

    def _abort(self, version: str) -> None:
        """After a failure: the transport undoes what the next sync cannot (best effort: the
        sync's own error is what gets reported); the servers stay paused."""
        try:
            self._transport.abort(version)
        except Exception:  # noqa: BLE001
            pass
