"""The health monitor's own stop: a restart it cuts short (the run is ending) is neither a failure
nor "the restart failed", and the process is not started again (not even as the retry of a
transient start failure). A launched server that dies of the same exception after a restart is
given up at once as a failure of its inputs; one killed from outside is restarted to its bound.

The restarted "server" is a process that never becomes healthy (a sleep): what is under test is
the monitor's stop while it waits, which is the same whatever the process is; real SGLang
restarts are tests/faults/test_faults_servers.py and test_faults_teacher.py."""
from __future__ import annotations

import sys
import threading
import time

from rollout.servers.health import OUT, HealthMonitor, ServerHealthSettings
from rollout.servers.managed_process import ManagedProcess, transient_cause
from rollout.servers.pool import ServerPool

URL = "http://127.0.0.1:1"


def test_a_restart_cut_short_by_the_runs_stop_is_not_a_failure(tmp_path):
    proc = ManagedProcess("SGLang server (port 1)", [sys.executable, "-c", "import time; time.sleep(600)"],
                          {}, URL, tmp_path / "server.log", ready_probe=lambda url: False).start()
    lines: list[str] = []
    pool = ServerPool([URL], log=lines.append)
    pool.take_out(URL, "health probe: /health_generate: connection refused")
    monitor = HealthMonitor(pool, ServerHealthSettings(server_health_interval_s=0.1),
                            launched={URL: proc}, log=lines.append).start()
    deadline = time.monotonic() + 30
    while not any("restarting it" in ln for ln in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)
    time.sleep(1.0)  # in restart(): waiting for a health that never comes
    t0 = time.monotonic()
    monitor.close()
    assert time.monotonic() - t0 < 15
    time.sleep(0.5)
    assert not proc.alive()
    assert pool.status(URL) == OUT and pool.reason(URL) == "health probe: /health_generate: connection refused"
    assert not any("restart failed" in ln for ln in lines), lines
    assert pool.pop_health_metrics()["rollout/server_failures"] == 1.0  # the probe's, not the stop's
    assert not any(t.name.startswith("sglang-health") and t.is_alive() for t in threading.enumerate())


def test_the_transient_start_failures_are_recognised_in_sglangs_own_words():
    kv = ("ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.05. "
          "Raise --mem-fraction-static above 0.061")
    assert transient_cause(kv).startswith("SGLang's KV-cache memory check at start")
    assert transient_cause("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                           "Current value: mem_fraction_static=0.05").startswith("SGLang's KV-cache")
    bind = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 42121): address already in use"
    assert transient_cause(bind) == "a port taken by another process"
    assert transient_cause("OSError: /models/x does not appear to have a file named config.json") is None


# SGLang's death on a request it cannot serve: the scheduler logs the traceback, says it, and the
# server SIGKILLs its process tree (rollout/servers/managed_process.py SELF_STOP).
_DIES_ON_A_REQUEST = ("import os, signal, time; time.sleep(0.3); "
                      "print('[2026-01-01 00:00:00] Scheduler hit an exception: Traceback (most recent call last):'); "
                      "print('  File \"embedding.py\", line 1, in forward'); "
                      "print('IndexError: index out of range in self', flush=True); os.kill(os.getpid(), signal.SIGKILL)")
# Killed from outside (the OOM killer, an operator) after a request error it handled and logged.
_KILLED_FROM_OUTSIDE = ("import os, signal, time; print('Traceback (most recent call last):'); "
                        "print('ValueError: The input (70 tokens) is longer than the context', flush=True); "
                        "time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)")


def _monitor_until_gone(tmp_path, code: str, max_restarts: int) -> tuple[ServerPool, list[str]]:
    from rollout.servers.health import GONE
    from rollout.servers.pool import TEACHER
    proc = ManagedProcess("teacher server (port 1)", [sys.executable, "-c", code], {}, URL,
                          tmp_path / "server.log", ready_probe=lambda url: True).start()
    lines: list[str] = []
    pool = ServerPool([URL], log=lines.append, role=TEACHER)
    time.sleep(0.6)  # dead of its own by now
    pool.take_out(URL, "health probe: /health_generate: connection refused")
    monitor = HealthMonitor(pool, ServerHealthSettings(server_health_interval_s=0.8, server_health_timeout_s=1.0,
                                                       server_max_restarts=max_restarts),
                            launched={URL: proc}, log=lines.append).start()
    deadline = time.monotonic() + 60
    while pool.status(URL) != GONE:
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)
    monitor.close()
    proc.kill()
    return pool, lines


def test_a_server_that_dies_the_same_way_after_a_restart_is_an_input_failure(tmp_path):
    """Before: a teacher that died on the first request (its server log: IndexError) was restarted
    three times and the run exited 75, which Slurm requeues up to 20 times. Now the second identical
    death gives it up as the inputs' failure, which the run ends with exit 2 (run/recovery.py)."""
    pool, lines = _monitor_until_gone(tmp_path, _DIES_ON_A_REQUEST, max_restarts=3)
    restarts = [ln for ln in lines if "restarting it" in ln]
    assert len(restarts) == 1, lines  # once: the second death is the same
    log = tmp_path / "server.log"
    assert pool.input_failure() == f"{URL}: IndexError: index out of range in self (log {log})"
    assert (f"teacher server {URL} stays out of service: it died the same way after a restart (IndexError: "
            f"index out of range in self; log {log}): a failure of its inputs, not restarted again") in lines


def test_a_server_killed_from_outside_is_restarted_to_its_bound_and_never_an_input_failure(tmp_path):
    pool, lines = _monitor_until_gone(tmp_path, _KILLED_FROM_OUTSIDE, max_restarts=2)
    assert len([ln for ln in lines if "restarting it" in ln]) == 2, lines
    assert pool.input_failure() is None
    assert "rollout.server_max_restarts=2 reached" in pool.reason(URL)
