"""Several SGLang servers behind one interface (optionally through sglang-router).

    pool = ServerPool(group.server_urls, router_url=group.router_url)
    out = pool.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 1.0})
    pool.update_weights_from_disk("/ckpt/hf-step-10", weight_version="10")

Generation goes through the router when one is given, else round robin over the live servers.
Each server has a status (rollout/servers/health.py): live servers generate; a server whose connection
fails, or that a health probe (rollout.servers.health.HealthMonitor) takes out, is `out`, and the requests
it was running move to the other servers; a server that comes back is `rejoining` until a weight
sync has loaded the current policy into it, and only then generates again. Control and
weight-update calls go to every live or rejoining server in parallel; one that cannot be reached
is taken out and the others go on. Requests for routed experts (routing replay) never go through
the router: sglang-router 0.3.2 drops the request's "return_routed_experts" field.

A pool's role (PoolRole) names its servers in every line, error and metric: the policy's servers
(POLICY: a server back serves only after a weight sync) or on-policy distillation's teacher
(TEACHER: never synced, so a server back serves at once; NoTeacherLeft when none is left).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence, TypeVar

from rollout.servers.client import GenerateOutput, SGLangClient, ServerUnavailable
from rollout.servers.errors import NoServerLeft, NoTeacherLeft, RequestAbandoned, TakenOut
from rollout.servers.health import GONE, LIVE, OUT, REJOINING

_SERVING = (LIVE,)
_SYNCED = (LIVE, REJOINING)  # the targets of a weight sync and of control calls


_Result = TypeVar("_Result")  # what a call on a server returns

@dataclasses.dataclass(frozen=True)
class PoolRole:
    """Whose servers a pool holds: how its lines, errors and metrics name them."""

    name: str
    """How a line names one server: "SGLang server", "teacher server"."""
    weight_synced: bool
    """A server that comes back serves only once a weight sync gave it the current policy
    (rejoining); False: at once (the teacher never receives the student's weights)."""
    metrics: tuple[str, str, str, str]
    """Tags of (servers live, failures, restarts, requests resubmitted): pop_health_metrics."""
    lost: type[NoServerLeft]
    """What a call raises when none of the pool's servers is in service."""


POLICY = PoolRole("SGLang server", True, ("rollout/servers_live", "rollout/server_failures",
                                          "rollout/server_restarts", "rollout/requests_resubmitted"),
                  NoServerLeft)
TEACHER = PoolRole("teacher server", False, ("distill/teachers_live", "distill/teacher_failures",
                                             "distill/teacher_restarts",
                                             "distill/teacher_requests_resubmitted"), NoTeacherLeft)


class ServerPool:
    """Several SGLang servers behind one interface.

    generate(): through `router_url` when given, else round robin over the live servers; a
    server that cannot be reached (or is taken out while the request runs) is taken out of service
    and the request goes to the next live server (the partial work there is lost and regenerated).
    When none is left, ServerUnavailable names every server and what happened to it. Everything
    else (abort, flush, pause, weight updates) goes to every live or rejoining server, in parallel.
    """

    def __init__(self, server_urls: Sequence[str], router_url: str | None = None, *,
                 timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5,
                 routed_experts_layout: tuple[int, int] | None = None,
                 log: Callable[[str], None] | None = None, role: PoolRole = POLICY):
        """routed_experts_layout: (num_hidden_layers, num_experts_per_tok) of the served model, to
        shape routed experts; None: read from a server's config.json when first needed.
        log: where a server's change of status is said (one line each); None: nowhere.
        role: whose servers these are (POLICY, TEACHER)."""
        if not server_urls:
            raise ValueError("ServerPool needs at least one server URL")
        self.role = role
        self.clients = [SGLangClient(u, timeout_s, retries, backoff_s) for u in server_urls]
        self.router = SGLangClient(router_url, timeout_s, retries, backoff_s) if router_url else None
        self.routed_experts_layout = routed_experts_layout
        self.log = log or (lambda line: None)
        self._status = {c.url: LIVE for c in self.clients}
        self._reason: dict[str, str] = {}
        self._input_failures: dict[str, str] = {}  # gone servers that died the same way twice
        self._counts: collections.Counter = collections.Counter()
        self.pause_epoch = 0  # counts pauses and continues: a probe across one is not judged
        self._targets: set[str] | None = None  # while paused for a sync: the servers it updates
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)),
                                            thread_name_prefix="sglang-pool")
        # A stop (a signal; the trainer sets these): a call still waiting abort_timeout_s after it
        # takes its server out if that one does not answer /model_info within 5 s (stalled),
        # instead of waiting for the health probe's longer timeout.
        self.stop_requested: Callable[[], bool] = lambda: False
        self.abort_timeout_s = 10.0

    @property
    def server_urls(self) -> list[str]:
        return [c.url for c in self.clients]

    # --- status ------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Paused for a weight sync (from pause_generation to continue_generation, or after a
        failed sync): the health probes do not ask these servers to generate."""
        return self._targets is not None

    def status(self, url: str) -> str:
        return self._status[url]

    def reason(self, url: str) -> str:
        return self._reason.get(url, "")

    def _clients(self, statuses: tuple[str, ...]) -> list[SGLangClient]:
        with self._lock:
            return [c for c in self.clients if self._status[c.url] in statuses]

    def live_clients(self) -> list[SGLangClient]:
        return self._clients(_SERVING)

    def use_adapter(self, name: str | None) -> None:
        """Every generation of this pool runs with LoRA adapter `name` (None: the base model):
        the servers' and the router's (rollout/servers/lora_adapters.py)."""
        for c in self.clients + ([self.router] if self.router is not None else []):
            c.lora_name = name

    def sync_clients(self) -> list[SGLangClient]:
        """The servers a weight sync goes to: live ones and those rejoining, fixed when the pause
        began (a server that rejoins during a sync missed part of it: it waits for the next)."""
        with self._lock:
            return [c for c in self.clients if self._status[c.url] in _SYNCED
                    and (self._targets is None or c.url in self._targets)]

    def _set(self, url: str, status: str, reason: str, line: str | None,
             only_from: tuple[str, ...] | None = None) -> bool:
        """Set the status (and reason) unless it is that already, the server is gone, or (only_from)
        it is not in one of those statuses; True when it changed."""
        with self._lock:
            now = self._status[url]
            if now == GONE and status != GONE or (only_from is not None and now not in only_from):
                return False
            self._reason[url] = reason  # a new reason even when the status stays (a failed restart)
            if now == status:
                return False
            self._status[url] = status
        if line:
            self.log(line)
        return True

    def take_out(self, url: str, reason: str) -> None:
        """Out of service (no generation, no sync) until the health monitor brings it back."""
        was = self._status[url]
        with self._lock:
            if self._targets is not None:
                self._targets.discard(url)  # back before the sync ends, it still waits for the next
        if self._set(url, OUT, reason, None) and was in _SYNCED:
            self._count("server_failures")
            live = len(self.live_clients())
            self.log(f"{self.role.name} {url} taken out of service: {reason} ({live} of "
                     f"{len(self.clients)} live)")

    def rejoin(self, url: str, reason: str) -> None:
        """Answers again: a policy server gets the current weights at the next sync, then
        generates; a teacher server (never synced) serves at once."""
        if not self.role.weight_synced:
            self._set(url, LIVE, "", f"{self.role.name} {url} {reason}: back in service")
            return
        self._set(url, REJOINING, reason, f"{self.role.name} {url} {reason}: it rejoins at the next "
                  "weight sync (it generates only once it holds the current weights)")

    def give_up(self, url: str, reason: str, input_failure: str | None = None) -> None:
        """Gone for good; input_failure: it died the same way on every try (HealthMonitor), a
        failure of the inputs that another start, or a requeued run, meets again."""
        if input_failure is not None:
            self._input_failures[url] = input_failure
        self._set(url, GONE, f"{self.reason(url)}; {reason}",
                  f"{self.role.name} {url} stays out of service: {reason}")

    def input_failure(self) -> str | None:
        """When every server of the pool is gone and one of them died the same way on every try:
        each such server and its failure, in one line; else None (a lost server: a requeued
        run may find it back)."""
        with self._lock:
            if not self._input_failures or any(s != GONE for s in self._status.values()):
                return None
            return "; ".join(f"{u}: {f}" for u, f in self._input_failures.items())

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def count_restart(self) -> None:
        self._count("server_restarts")

    def synced(self, version: str) -> None:
        """After a weight sync that every sync target confirmed: the rejoining ones serve again
        (not one taken out meanwhile)."""
        for c in self.sync_clients():
            self._set(c.url, LIVE, "", f"{self.role.name} {c.url} back in service at weight version "
                      f"{version}", only_from=(REJOINING,))

    def summary(self) -> str:
        """Every server and what happened to it, for the line that ends a run without servers."""
        return "; ".join(f"{u}: {s}" + (f" ({self._reason[u]})" if self._reason.get(u) else "")
                         for u, s in self._status.items())

    def pop_health_metrics(self) -> dict[str, float]:
        """Servers live now; failures, restarts and resubmitted requests since the last call (the
        role's tags: rollout/servers_live, ... or distill/teachers_live, ...)."""
        with self._lock:
            counts, self._counts = self._counts, collections.Counter()
        live, failures, restarts, resubmitted = self.role.metrics
        return {live: float(len(self.live_clients())),
                failures: float(counts["server_failures"]),
                restarts: float(counts["server_restarts"]),
                resubmitted: float(counts["requests_resubmitted"])}

    # --- calls -------------------------------------------------------------------------------
    def _watched(self, client: SGLangClient, call: Callable[[SGLangClient], _Result],
                 statuses: tuple[str, ...], abandon: threading.Event | None = None) -> _Result:
        """call(client) on a thread of its own; its result, or ServerUnavailable as soon as the
        client leaves `statuses` (taken out by a probe) while the call runs, or RequestAbandoned
        once `abandon` is set. The abandoned thread ends with its HTTP request: at once for a
        killed server, by the request's timeout for a stalled one, or when a restart kills the
        stalled one; its answer goes nowhere."""
        box: Future[_Result] = Future()

        def run() -> None:
            try:
                box.set_result(call(client))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box.set_exception(e)
        threading.Thread(target=run, daemon=True, name="sglang-call").start()
        stop_seen: float | None = None
        while True:
            try:
                return box.result(timeout=0.5)
            except FutureTimeout:
                if abandon is not None and abandon.is_set():
                    raise RequestAbandoned(client.url, "abandoned: no answer within "
                                           "rollout.abort_timeout_s of the abort") from None
                if self.stop_requested() and client.url in self._status:
                    # after a signal, a call still waiting after abort_timeout_s asks whether its
                    # server is stalled (a busy one, e.g. loading weights, answers /model_info)
                    stop_seen = stop_seen or time.monotonic()
                    if time.monotonic() - stop_seen > self.abort_timeout_s:
                        from rollout.servers.health import probe
                        why = probe(client.url, 5.0, generate=False)
                        if why is not None:
                            raise ServerUnavailable(client.url, f"stalled after the stop signal: {why}") from None
                        stop_seen = time.monotonic()  # answers: ask again after another bound
                if self._status.get(client.url, LIVE) not in statuses:  # (the router has none)
                    raise TakenOut(client.url, f"taken out of service while the request ran "
                                   f"({self.reason(client.url)})") from None

    def _next_client(self) -> SGLangClient | None:
        live = self.live_clients()
        return live[next(self._rr) % len(live)] if live else None

    def _layout(self) -> tuple[int, int]:
        for client in [] if self.routed_experts_layout else self.live_clients():
            try:
                self.routed_experts_layout = client.routed_experts_layout()
                break
            except ServerUnavailable as e:
                self.take_out(client.url, e.message)
        if self.routed_experts_layout is None:
            raise self.role.lost(", ".join(self.server_urls), f"no live {self.role.name} left ({self.summary()})")
        return self.routed_experts_layout

    def generate(self, input_ids: Sequence[int], sampling_params: dict, *, rid: str | None = None,
                 timeout_s: float | None = None, return_routed_experts: bool = False,
                 abandon: threading.Event | None = None) -> GenerateOutput:
        """One prompt -> one GenerateOutput (see SGLangClient.generate); return_routed_experts:
        with GenerateOutput.routed_experts (directly from a server, never through the router).
        abandon: once set, the wait ends with RequestAbandoned (the rollout's bounded drain)."""
        kw: dict[str, Any] = {"rid": rid, "timeout_s": timeout_s}
        if return_routed_experts:
            kw.update(return_routed_experts=True, routed_experts_layout=self._layout())
        elif self.router is not None and len(self.live_clients()) == len(self.clients):
            # the router knows nothing of the statuses: while a server is out or rejoining (it may
            # hold other weights), requests go round robin over the live ones instead
            return self._watched(self.router, lambda c: c.generate(input_ids, sampling_params, **kw)[0],
                                 _SERVING, abandon)
        return self._on_a_live_server(lambda c: c.generate(input_ids, sampling_params, **kw)[0], abandon)

    def input_log_probs(self, input_ids: Sequence[int], start: int, timeout_s: float | None = None) -> list[float]:
        """Log-probs of input_ids[start:] from one prefill on a live server (SGLangClient.input_log_probs)."""
        return self._on_a_live_server(lambda c: c.input_log_probs(input_ids, start, timeout_s=timeout_s))

    def _on_a_live_server(self, call: Callable[[SGLangClient], _Result],
                          abandon: threading.Event | None = None) -> _Result:
        """call(client) on the next live server (round robin); a server that cannot be reached, or
        is taken out meanwhile, is out of service and the call moves on (counted in
        rollout/requests_resubmitted); none left: the role's NoServerLeft naming each server once."""
        errors: dict[str, str] = {}
        while True:
            client = self._next_client()
            if client is None:  # one line, each server's URL once, never an empty reason
                what = "; ".join(f"{u}: {r}" for u, r in errors.items()) if len(errors) != 1 else \
                    next(iter(errors.values()))
                raise self.role.lost(", ".join(self.server_urls), f"no live {self.role.name} left "
                                     f"({what or self.summary()})")
            if errors:
                self._count("requests_resubmitted")
            try:
                return self._watched(client, call, _SERVING, abandon)
            except TakenOut as e:  # out already, with its own reason: said once, never nested
                errors[client.url] = self.reason(client.url) or e.message
            except ServerUnavailable as e:
                errors[client.url] = e.message
                self.take_out(client.url, e.message)

    def for_each(self, fn: Callable[[SGLangClient], _Result], live_only: bool = True) -> list[_Result | None]:
        """Call fn(client) on every live or rejoining server (every server: live_only=False) in
        parallel; results in server order. A server that cannot be reached is taken out of service
        (its result is None) and the others go on, unless none answered; any other error is raised
        after all calls have finished."""
        clients = self.sync_clients() if live_only else self.clients
        return self._for_clients(clients, fn, _SYNCED if live_only else (LIVE, OUT, REJOINING, GONE))

    def _for_clients(self, clients: list[SGLangClient], fn: Callable[[SGLangClient], _Result],
                     statuses: tuple[str, ...]) -> list[_Result | None]:
        futures = [self._executor.submit(self._watched, c, fn, statuses) for c in clients]
        results: list[_Result | None] = []
        first_error: BaseException | None = None
        lost: list[ServerUnavailable] = []
        for c, f in zip(clients, futures):
            try:
                results.append(f.result())
            except ServerUnavailable as e:
                results.append(None)
                lost.append(e)
                if not isinstance(e, TakenOut):  # out already: its reason stays the first one
                    self.take_out(c.url, e.message)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every call returned
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        if lost and len(lost) == len(clients):
            raise self.role.lost(", ".join(c.url for c in clients), f"every server was lost "
                               f"({'; '.join(e.message for e in lost)})") from lost[0]
        return results

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run a blocking call (e.g. init_weights_update_group) in the pool's threads."""
        return self._executor.submit(fn, *args, **kwargs)

    def abort_all(self) -> None:
        """Abort every request on every live server (their /generate calls return "abort")."""
        self.for_each(lambda c: c.abort(abort_all=True))

    def flush_cache(self) -> None:
        self.for_each(lambda c: c.flush_cache())

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause every live or rejoining server: the start of a weight sync, whose targets they are."""
        with self._lock:
            self.pause_epoch += 1
            self._targets = {u for u, s in self._status.items() if s in _SYNCED}
        if not self._targets:
            raise self.role.lost(", ".join(self.server_urls), f"no server to pause ({self.summary()})")
        self.for_each(lambda c: c.pause_generation(mode))

    def continue_generation(self) -> None:
        self.for_each(lambda c: c.continue_generation())
        with self._lock:
            self.pause_epoch, self._targets = self.pause_epoch + 1, None

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 **kw: Any) -> list[dict | None]:
        """Every server reloads from `model_path` (see SGLangClient.update_weights_from_disk)."""
        return self.for_each(lambda c: c.update_weights_from_disk(model_path, weight_version, **kw))

    def weight_versions(self) -> dict[str, str]:
        """url -> the weight version it reports, for every live or rejoining server that answers."""
        clients = self.sync_clients()
        versions = self._for_clients(clients, lambda c: c.weight_version(), _SYNCED)
        return {c.url: v for c, v in zip(clients, versions) if v is not None and self._status[c.url] in _SYNCED}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
