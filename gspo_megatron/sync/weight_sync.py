"""Push the trainer's weights into the SGLang servers after an optimizer step.

    sync = WeightSync(chunks, hf_config, transport=TensorTransport(pool), pool=pool)  # every rank
    report = sync.sync(version=step)     # collective; pool/transport are used on rank 0 only

One sync (senders="owners", the default, _sync_owners): rank 0 pauses generation on every server
(running requests are retracted and re-run with the new weights) and opens their update sessions;
every owner sends its own buckets, whole or as deltas (owner_pass.py, through any transport);
rank 0 judges the senders' outcomes, sets the new version, checks that every server reports it,
continues generation. With senders="rank0" (_attempt) rank 0 alone streams the weights
(stream.py) through the transport and sets the version with the last piece.
The servers are the pool's live and rejoining ones (rollout/servers/health.py): a server that came back
after a failure gets the weights here and serves only after its version checked out. A server
lost part-way (every-owner passes, and the rank-0 distributed broadcast) is taken out, and since
the servers still there may hold part of the new weights the whole sync runs again (every rank
streams again) on the servers there are, at most once per server; through rank 0 the tensor and
disk transports just go on with the others. No server left to take the weights:
WeightSyncError(no_server=True), and the trainer waits for one (trainer.sync_weights).
If anything else fails part-way, the transport
undoes what would stop the next sync (Transport.abort), the servers are LEFT PAUSED (they may
hold a mix of old and new weights, so they must not generate), `stale` is set, and every rank
raises WeightSyncError; a later successful sync (all weights are sent each time) un-pauses them.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from gspo_errors import GspoError
from gspo_megatron.sync.owner_pass import CHECK_FIRST_DELTAS, PassPlan, SenderState, run_pass
from gspo_megatron.sync.owners import assign_senders
from gspo_megatron.sync.stream import build_plan, buckets, stream_hf_weights
from gspo_megatron.sync.transports import Transport, begin_session
from model_specs.weight_maps import weight_map_for


def _in_chain(error: BaseException | None, types: tuple[type[BaseException], ...]) -> bool:
    while error is not None:
        if isinstance(error, types):
            return True
        error = error.__cause__ or error.__context__
    return False


def _unreachable(error: BaseException | None) -> bool:
    """A lost connection anywhere in the error's chain (rollout.servers.client.ServerUnavailable, or the
    transport's own ConnectionError)."""
    from rollout.servers.client import ServerUnavailable
    return _in_chain(error, (ServerUnavailable, ConnectionError))


# The transports every owner sends through itself (all of them, with sync.senders=owners), and
# whether they can send deltas.
OWNER_TRANSPORTS = {"tensor": True, "distributed": True, "disk": False}


class WeightSyncError(GspoError, RuntimeError):
    """A sync that did not complete; the servers are paused and marked stale. no_server: because
    no server was left to take it (rollout/servers/health.py; the trainer waits for one, trainer.py)."""

    def __init__(self, message: str, no_server: bool = False) -> None:
        super().__init__(message)
        self.no_server = no_server


class WeightSync:
    """Weight sync of one trainer job (construct on every rank; `transport` and `pool` are only
    used on global rank 0 and may be None elsewhere)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hf_config: Mapping[str, Any],
                 transport: Transport | None, pool=None, *, bucket_bytes: int = 256 << 20,
                 pause_mode: str = "retract", senders: str = "owners", delta: bool = True) -> None:
        if senders not in ("owners", "rank0"):
            raise ValueError(f"senders={senders!r}: expected 'owners' or 'rank0'")
        self.chunks = list(chunks)
        self.hf_config = dict(hf_config)
        self.senders, self.delta = senders, delta
        self._owner_state = SenderState()
        self._delta_ready = False  # the servers in sync hold what the encoders' bases say
        self._deltas_sent = 0
        self._mode: str | None = None
        self._served_dtype: str | None = None
        self.wmap = weight_map_for(hf_config)
        self.transport, self.pool = transport, pool
        self.bucket_bytes, self.pause_mode = bucket_bytes, pause_mode
        self.rank = dist.get_rank()
        if self.rank == 0 and (transport is None or pool is None):
            raise ValueError("WeightSync on rank 0 needs a transport and the server pool")
        self._plan = None
        self.version: str | None = None  # the version the servers serve, as far as we know
        self.stale = False               # True after a failed sync: servers paused, weights mixed

    def sync(self, version: str | int, again: bool = False) -> dict[str, float]:
        """Collective. Returns {seconds, bytes, gb_per_s, buckets, attempts} (rank 0's view on
        rank 0). again: the version the servers already serve, for servers that came back
        (rollout/servers/health.py)."""
        version = str(version)
        if version == self.version and not again:
            raise ValueError(f"weight version {version!r} is what the servers already serve; "
                             "every sync needs a new version")
        if self._plan is None:
            self._plan = build_plan(self.chunks, self.wmap)
            self._sender_of = assign_senders(self._plan)
        if self._mode is None:
            mode = [("owners" if self.senders == "owners" and getattr(self.transport, "name", "") in OWNER_TRANSPORTS
                     else "rank0") if self.rank == 0 else None]
            dist.broadcast_object_list(mode, src=0)
            self._mode = mode[0]
        if self._mode == "owners":
            return self._sync_owners(version)
        n_buckets = len(buckets(self._plan, self.bucket_bytes))
        start = time.perf_counter()
        # A server lost part-way leaves the others with part of the weights: the sync runs again
        # on the servers there are, at most once per server (each retry has one server fewer).
        # Rank 0 decides (its pool), the others follow its broadcast.
        from rollout.servers.errors import NoServerLeft
        attempt = 0
        while True:
            attempt += 1
            sent, error = self._attempt(version, n_buckets)
            unreachable, no_server = _unreachable(error), _in_chain(error, (NoServerLeft,))
            retry = (self.rank == 0 and unreachable and not no_server
                     and attempt <= len(self.pool.clients) and bool(self.pool.sync_clients()))
            if self.rank == 0 and error is not None:
                self._abort(version)
            message = [f"{type(error).__name__}: {error}" if error is not None else None,
                       unreachable, no_server, retry]
            dist.broadcast_object_list(message, src=0)
            if not message[3]:
                break
        if message[0] is not None:
            self.stale = True
            after = ("A server could not be reached (did it die?): restart it, then sync again; "
                     "servers still up are paused" if message[1] else
                     "The servers are left paused") + " and may hold a mix of old and new weights; " \
                "sync again before generating."
            raise WeightSyncError(f"weight sync to version {version} via "
                                  f"{getattr(self.transport, 'name', '?')} failed: {message[0]}. {after}",
                                  no_server=message[2])
        self.stale, self.version = False, version
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": float(sent), "buckets": float(n_buckets),
                "gb_per_s": sent / seconds / 1e9 if seconds > 0 else 0.0, "attempts": float(attempt),
                "rank0_bytes": float(sent), "senders": 1.0, "changed_fraction": 1.0,
                "full_syncs": float(len(self.pool.sync_clients())) if self.rank == 0 else 0.0,
                "checksum_mismatches": 0.0}

    # --- every owner sends (tensor, distributed and disk transports) ---------------------------
    def _served(self) -> str:
        """The servers' dtype (rank 0): their launch argument, else the model config's."""
        if self._served_dtype is None:
            got = {c.served_dtype() for c in self.pool.sync_clients()}
            got = {self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
                   if d == "auto" else d for d in got}
            if len(got) != 1:
                raise WeightSyncError(f"the servers serve different dtypes {sorted(got)}: one sync "
                                      "cannot be bit-exact for all of them")
            self._served_dtype = str(got.pop()).removeprefix("torch.")
        return self._served_dtype

    def _targets(self, repair: list[str] | None, delta: bool) -> dict[str, str]:
        """Rank 0: which servers get this pass, and how: a delta where the server is live and
        reports the version every encoder's base holds, else the full weights."""
        from rollout.servers.health import LIVE
        if repair:
            return {u: "full" for u in repair}
        clients = self.pool.sync_clients()
        if not clients:
            from rollout.servers.errors import NoServerLeft
            raise NoServerLeft(f"no server is left to take the weights ({self.pool.summary()})")
        delta = delta and self._delta_ready
        versions = self.pool.weight_versions() if delta else {}
        return {c.url: "delta" if (delta and self.pool.status(c.url) == LIVE
                                   and versions.get(c.url) == self.version) else "full"
                for c in clients}

    def _sync_owners(self, version: str) -> dict[str, float]:
        """Collective: rank 0 pauses and opens the servers' sessions, every owner sends its own
        buckets (owner_pass.run_pass), rank 0 checks, repairs a checksum mismatch with a full
        pass to that server, sets the version, closes the sessions, continues generation."""
        from rollout.servers.errors import NoServerLeft
        from rollout.servers.health import LIVE
        start = time.perf_counter()
        totals = {"bytes": 0, "rank0_bytes": 0, "elements": 0, "changed": 0, "buckets": 0,
                  "senders": set(), "full": 0, "mismatches": 0, "stream_s": 0.0, "encode_s": 0.0,
                  "post_s": 0.0}
        attempt, repair = 0, None
        totals["repaired"] = False
        while True:
            attempt += 1
            message: list = [None, None, False]
            if self.rank == 0:
                try:
                    disk = self.transport.name == "disk"
                    delta = self.delta and OWNER_TRANSPORTS[self.transport.name]
                    if repair is None:
                        self.pool.pause_generation(self.pause_mode)
                        if self.transport.name == "distributed":  # the senders make their groups
                            self.pool.for_each(begin_session)
                        else:  # the sessions (tensor), the folder (disk)
                            self.transport.begin(version)
                    # after the pause and the sessions: a server they took out is no target
                    targets = self._targets(repair, delta)
                    check = not disk and self._deltas_sent < CHECK_FIRST_DELTAS
                    message[0] = PassPlan(
                        version, targets, check, self._served(), keep_base=delta,
                        disk_dir=str(self.transport.folder(version)) if disk else None,
                        transport=self.transport.name,
                        server_tp=dict(getattr(self.transport, "tp_size_of", {})),
                        # a server that came back holds none of the senders' groups
                        regroup=[u for u in targets if self.pool.status(u) != LIVE],
                        timeout_s=float(getattr(self.transport, "timeout_s", 300.0)))
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    message[1:] = [f"{type(e).__name__}: {e}", _in_chain(e, (NoServerLeft,))]
            dist.broadcast_object_list(message, src=0)
            plan, error, no_server = message
            outcomes: list = [None] * dist.get_world_size()
            if plan is not None:
                mine = run_pass(self._owner_state, self.chunks, self.wmap, self._plan, self._sender_of,
                                self.bucket_bytes, plan)
                dist.all_gather_object(outcomes, mine)
            verdict: list = [None, None, False, False]  # error, repair urls, retry, no_server
            if self.rank == 0:
                verdict = self._judge(plan, error, no_server, outcomes, totals, attempt)
            dist.broadcast_object_list(verdict, src=0)
            error, repair, retry, no_server = verdict
            if error is not None:
                # some server may hold part of this version: every sender's base is void
                if self._owner_state.encoder is not None:
                    self._owner_state.encoder.invalidate()
                self._delta_ready = False
                if retry:
                    repair = None
                    continue
                self.stale = True
                raise WeightSyncError(f"weight sync to version {version} (every owner sending) "
                                      f"failed: {error}. The servers are left paused and may "
                                      "hold a mix of old and new weights; sync again before "
                                      "generating.", no_server=no_server)
            if not repair:
                break
        self.stale, self.version, self._delta_ready = False, version, True
        if plan is not None and any(m == "delta" for m in plan.targets.values()):
            self._deltas_sent += 1
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": float(totals["bytes"]), "buckets": float(totals["buckets"]),
                "gb_per_s": totals["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
                "attempts": float(attempt), "rank0_bytes": float(totals["rank0_bytes"]),
                "senders": float(len(totals["senders"])),
                "changed_fraction": totals["changed"] / max(1, totals["elements"]),
                "full_syncs": float(totals["full"]), "checksum_mismatches": float(totals["mismatches"]),
                "stream_seconds": totals["stream_s"], "encode_seconds": totals["encode_s"],
                "post_seconds": totals["post_s"]}

    def _judge(self, plan, error, no_server, outcomes, totals, attempt) -> list:
        """Rank 0, after a pass: [error, repair urls, retry, no_server]. A server lost part-way is
        taken out and the sync runs again (full) on the others, at most once per server; a
        checksum mismatch gets that server a full pass (once); otherwise the version is set."""
        if plan is not None:
            for o in outcomes:
                if o.sent_bytes:
                    totals["senders"].add(o.rank)
                totals["bytes"] += o.sent_bytes
                totals["rank0_bytes"] += o.sent_bytes if o.rank == 0 else 0
                totals["buckets"] += o.buckets
                totals["elements"] += o.elements
                totals["changed"] += o.changed
                for k in ("stream_s", "encode_s", "post_s"):  # the slowest sender's
                    totals[k] = max(totals[k], getattr(o, k))
            totals["full"] += sum(m == "full" for m in plan.targets.values())
            failed = [o for o in outcomes if o.error is not None]
            if failed and error is None:
                error = f"rank {failed[0].rank}: {failed[0].error}"
            lost = sorted({u for o in outcomes for u in o.lost})
            for url in lost:
                self.pool.take_out(url, f"lost during a weight sync: {error}")
            if error is not None:
                self._abort(plan.version)  # disk: the half-written folder goes
                retry = bool(lost) and attempt <= len(self.pool.clients) and bool(self.pool.sync_clients())
                return [error, None, retry, not self.pool.sync_clients()]
            wrong = sorted({u for o in outcomes for u in o.mismatched})
            totals["mismatches"] += sum(len(v) for o in outcomes for v in o.mismatched.values())
            if wrong:
                if totals["repaired"]:
                    return [f"servers {wrong} still differ from the trainer after a full sync "
                            f"({totals['mismatches']} tensors)", None, False, False]
                totals["repaired"] = True
                return [None, wrong, False, False]
        if error is not None:
            return [error, None, False, no_server]
        try:
            if plan.disk_dir is not None:  # finish() writes the index of every owner's shards
                self.transport.adopt({n: f for o in outcomes for n, f in o.files.items()},
                                     sum(o.sent_bytes for o in outcomes))
            else:  # the version, set by a last empty request through the project's loader
                from rollout.in_server.weight_loader import LOADER
                self.pool.for_each(lambda c: c.update_weights_from_tensor(
                    [], weight_version=plan.version, flush_cache=True, load_format=LOADER))
            self._finish(plan.version)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            return [f"{type(e).__name__}: {e}", None, False, False]
        return [None, None, False, False]

    def _attempt(self, version: str, n_buckets: int) -> tuple[int, BaseException | None]:
        """One pass: pause and begin (rank 0), stream every bucket (every rank), finish (rank 0).
        Returns rank 0's bytes sent and its first error (None elsewhere)."""
        sent, error = 0, None
        if self.rank == 0:
            error = self._try(lambda: (self.pool.pause_generation(self.pause_mode),
                                       self.transport.begin(version)))
        for i, bucket in enumerate(stream_hf_weights(self.chunks, self.wmap, self._plan,
                                                     self.bucket_bytes)):
            # Failed on rank 0: keep walking the stream so the other ranks' collectives finish.
            if self.rank == 0 and error is None:
                error = self._try(lambda: self.transport.send(bucket, i == n_buckets - 1, version))
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
        if self.rank == 0 and error is None:
            error = self._try(lambda: self._finish(version))
        return sent, error

    def _abort(self, version: str) -> None:
        """After a failed pass: the transport undoes what the next pass cannot (the distributed
        group broken here, a half-written directory); the servers stay paused. Best effort: the
        sync's own error is what gets reported."""
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            self._try(lambda: abort(version))

    def _finish(self, version: str) -> None:
        self.transport.finish(version)
        served = self.pool.weight_versions()  # of the servers still in the sync
        wrong = {url: v for url, v in served.items() if v != version}
        if wrong:
            raise WeightSyncError(f"servers report weight versions {wrong} after the update, "
                                  f"expected {version!r}")
        if not served:
            raise WeightSyncError(f"no server is left to take version {version!r} "
                                  f"({self.pool.summary()})")
        self.pool.synced(version)  # servers that came back hold the policy now: they serve again
        self.pool.continue_generation()

    @staticmethod
    def _try(fn) -> BaseException | None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank by sync()
            return e
        return None
