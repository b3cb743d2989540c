"""The health monitor's own stop: a restart it cuts short (the run is ending) is neither a failure
nor "the restart failed", and the process is not started again (not even as the retry of a
transient start failure).

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
