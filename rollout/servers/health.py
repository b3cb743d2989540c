"""Server health in long runs: probe every SGLang server, take a failed one out of service, bring
it back (restart, or wait for it), and never let it generate before it holds the current weights.

    monitor = HealthMonitor(pool, ServerHealthSettings(), launched=group.launched())
    monitor.start()          # one prober thread per server; pool.pop_health_metrics() counts
    ...
    monitor.close()

A server's life in the pool (ServerPool.status):
    live ──(probe fails, or a request or sync call cannot reach it)──> out
    out ──(restarted and healthy, or an attached server answers again)──> rejoining
    rejoining ──(the next weight sync loads the policy and checks its version)──> live
    out ──(restart bound reached)──> gone (one line; it stays out)
A teacher's pool (rollout.servers.pool.TEACHER) goes from out straight back to live: it never holds the
student's weights, and a restarted server is healthy only once its model is loaded and generates
(its /health is /health_generate: one token, below).

The probe is SGLang's /health_generate (one token, or nothing when the server is busy: it
answers once the scheduler has produced anything, sglang/srt/entrypoints/http_server.py health_generate) while
the servers generate, and /model_info while the pool is paused for a weight sync, and to see
whether an attached server is back: a paused server cannot generate, and in SGLang 0.5.23 /health
is the same handler as /health_generate (both routes on health_generate, with
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on by default), so both would fail there after 20 s.
No answer within server_health_timeout_s, or a non-200 answer, takes the server out: its in-flight requests move to the other servers
(ServerPool._on_a_live_server), the weight sync skips it, and a server the run launched is
restarted with the same command line and port.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Mapping

import requests

LIVE, OUT, REJOINING, GONE = "live", "out", "rejoining", "gone"


@dataclasses.dataclass
class ServerHealthSettings:
    """How the run watches its SGLang servers (rollout section of the run config)."""

    server_health_interval_s: float = 5.0
    """Seconds between two probes of a server."""
    server_health_timeout_s: float = 30.0
    """A server that does not answer its probe within this is taken out of service (its requests
    go to the other servers). More than SGLang's own 20 s bound on /health_generate
    (SGLANG_HEALTH_CHECK_TIMEOUT), far less than rollout.request_timeout_s."""
    server_max_restarts: int = 3
    """Restarts of one launched server; past it the server stays out (one line says so)."""
    server_max_restarts_per_run: int = 8
    """Restarts of all servers together in this process (a resume starts a new count)."""
    server_wait_s: float = 300.0
    """When no server is left: after saving a checkpoint, wait this long for one to come back
    (restarted and resynced), then exit with code 75 (EXIT_NO_SERVER: a requeue may retry)."""


EXIT_NO_SERVER = 75
"""The trainer's exit code when no SGLang server is left (EX_TEMPFAIL): launch/slurm/job.sh
requeues the job on it, like a preemption."""


def probe(url: str, timeout_s: float, generate: bool) -> str | None:
    """None when the server answers 200 within timeout_s, else why not (one short phrase).
    generate: /health_generate (the scheduler works), else /model_info (the HTTP server answers)."""
    path = "/health_generate" if generate else "/model_info"
    try:
        resp = requests.get(url + path, timeout=timeout_s)
    except requests.Timeout:
        return f"no answer to {path} within {timeout_s:g} s"
    except requests.RequestException as e:
        from rollout.servers.client import connection_failure_reason
        return f"{path}: {connection_failure_reason(e)}"
    return None if resp.status_code == 200 else f"{path} answered {resp.status_code}"


class HealthMonitor:
    """One daemon thread per server of `pool`: probes it while it serves, and brings it back when
    it is out: `launched[url].restart()` (rollout.servers.launch.ManagedProcess: kill and relaunch with the
    same arguments; blocks until healthy or raises) for servers the run launched, polling for
    attached ones (not in `launched`). Restarts are bounded per server and per monitor
    (ServerHealthSettings). close() kills a server still restarting, so none outlives it."""

    def __init__(self, pool, settings: ServerHealthSettings, launched: Mapping[str, Any] | None = None,
                 log: Callable[[str], None] = lambda line: print(f"[gspo] {line}", flush=True)):
        self.pool, self.settings, self.log = pool, settings, log
        self.launched = dict(launched or {})
        self.restarts: dict[str, int] = {url: 0 for url in pool.server_urls}
        self._deaths: dict[str, str | None] = {}  # a launched server's last death of its own (its exception)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._restarting: set[str] = set()  # servers in launched[url].restart() now
        self._threads = [threading.Thread(target=self._watch, args=(url,), daemon=True,
                                          name=f"sglang-health-{i}")
                         for i, url in enumerate(pool.server_urls)]

    def start(self) -> "HealthMonitor":
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """Stop probing; a restart under way is cut short (its process killed: wait_healthy then
        fails at once) so that no server starts after the caller stops the servers. A probe under
        way is not waited for (a stalled server holds it up to server_health_timeout_s, and a
        signal's stop must not wait that long): its daemon thread ends with the probe, and judges
        nothing once stopped."""
        self._stop.set()
        deadline = time.monotonic() + 2.0
        for url, t in zip(self.pool.server_urls, self._threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            with self._lock:
                restarting = url in self._restarting
            if t.is_alive() and restarting:  # in restart(): its wait_healthy
                self.launched[url].halt()
                t.join(timeout=30)

    def _watch(self, url: str) -> None:
        # Server restarts happen on this thread, which lives as long as the monitor: a launched
        # server dies with the thread that started it (rollout/servers/launch.py: _die_with_parent).
        s = self.settings
        while not self._stop.wait(s.server_health_interval_s):
            status = self.pool.status(url)
            if status in (LIVE, REJOINING):
                epoch, t0 = self.pool.pause_epoch, time.monotonic()
                why = probe(url, s.server_health_timeout_s, generate=not self.pool.paused)
                if why is not None and self.pool.pause_epoch != epoch and self.pool.paused:
                    # a pause that began during the probe can fail /health_generate (not the
                    # server's fault): ask /model_info for the rest of the timeout instead, so that
                    # a server stalled just before a sync is still out within the timeout
                    epoch, left = self.pool.pause_epoch, s.server_health_timeout_s - (time.monotonic() - t0)
                    why = probe(url, max(left, 1.0), generate=False)
                if why is not None and not self._stop.is_set() and self.pool.pause_epoch == epoch:
                    self.pool.take_out(url, f"health probe: {why}")
            elif status == OUT:
                self._bring_back(url)

    def _bring_back(self, url: str) -> None:
        s, name = self.settings, self.pool.role.name
        if url not in self.launched:  # an attached server: someone else restarts it; poll
            if probe(url, s.server_health_timeout_s, generate=False) is None:
                self.pool.rejoin(url, "answers again")
            return
        cause = self.launched[url].death_cause()
        if cause is not None and cause == self._deaths.get(url):
            # it died of the same exception after a restart, on the requests that came again: the
            # inputs' failure (the model, its config, the prompts), which no restart or requeue mends
            self.pool.give_up(url, f"it died the same way after a restart ({cause}; log "
                              f"{self.launched[url].log_path}): a failure of its inputs, not restarted again",
                              input_failure=f"{cause} (log {self.launched[url].log_path})")
            return
        self._deaths[url] = cause
        with self._lock:
            if self._stop.is_set():  # (checked under the lock close() reads _restarting with)
                return
            total = sum(self.restarts.values())
            if self.restarts[url] >= s.server_max_restarts or total >= s.server_max_restarts_per_run:
                bound = (f"rollout.server_max_restarts={s.server_max_restarts}"
                         if self.restarts[url] >= s.server_max_restarts
                         else f"rollout.server_max_restarts_per_run={s.server_max_restarts_per_run}")
                self.pool.give_up(url, f"not restarted again: {bound} reached")
                return
            self.restarts[url] += 1
            self._restarting.add(url)
        self.pool.count_restart()
        self.log(f"{name} {url} is out ({self.pool.reason(url)}): restarting it "
                 f"({self.restarts[url]} of {s.server_max_restarts})")
        t0 = time.monotonic()
        try:
            self.launched[url].restart(log=self.log)
        except Exception as e:  # noqa: BLE001 - the server stays out; the bound decides what next
            if self._stop.is_set():  # close() killed it: the run's own stop, not the server's fault
                return
            first = (str(e).splitlines() or [""])[0][:300]
            self.pool.take_out(url, f"restart failed: {type(e).__name__}: {first}")
            self.log(f"{name} {url}: the restart failed ({type(e).__name__}: {first})")
            return
        finally:
            with self._lock:
                self._restarting.discard(url)
        self.pool.rejoin(url, f"restarted in {time.monotonic() - t0:.0f} s")
