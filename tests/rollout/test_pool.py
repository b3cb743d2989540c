"""The server pool's bookkeeping when a server is taken out while many requests run on it: each
request moves on, the reason is said once (never nested), a teacher's pool names the teacher, and
a teacher server that comes back serves at once (it never needs the student's weights).

No SGLang server is needed for the bookkeeping: the calls are callables that wait on an event,
the pool's own threads watch their server's status exactly as for a real request."""
from __future__ import annotations

import threading
import time

import pytest

from rollout.servers.errors import NoServerLeft, NoTeacherLeft
from rollout.servers.health import LIVE, OUT
from rollout.servers.pool import TEACHER, ServerPool

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _run_many(pool: ServerPool, n: int, served: list[str], release: threading.Event) -> list[threading.Thread]:
    def call(client):
        if client.url == A:
            release.wait(30)  # held until the test takes A out
            raise AssertionError("a request on a server taken out must not come back from it")
        served.append(client.url)
        return client.url

    threads = [threading.Thread(target=lambda: pool._on_a_live_server(call), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_server_taken_out_under_many_requests_keeps_one_reason_and_they_move_on():
    lines: list[str] = []
    pool = ServerPool([A, B], log=lines.append)
    pool._rr = iter(range(0, 1000, 2))  # every request starts on A
    served, release = [], threading.Event()
    threads = _run_many(pool, 8, served, release)
    time.sleep(1.0)  # all eight wait on A
    pool.take_out(A, "health probe: no answer to /health_generate within 10 s")
    for t in threads:
        t.join(timeout=10)
    release.set()
    assert served == [B] * 8  # each request moved to the live server
    assert pool.reason(A) == "health probe: no answer to /health_generate within 10 s"  # said once
    assert pool.pop_health_metrics() == {"rollout/servers_live": 1.0, "rollout/server_failures": 1.0,
                                         "rollout/server_restarts": 0.0, "rollout/requests_resubmitted": 8.0}
    assert lines == [f"SGLang server {A} taken out of service: health probe: no answer to "
                     "/health_generate within 10 s (1 of 2 live)"]
    pool.take_out(B, "connection refused")
    with pytest.raises(NoServerLeft, match="no live SGLang server left") as e:
        pool._on_a_live_server(lambda c: c.url)
    assert str(e.value).count("taken out of service while the request ran") == 0
    pool.close()


def test_a_teacher_pool_names_the_teacher_and_a_teacher_back_serves_at_once():
    lines: list[str] = []
    pool = ServerPool([A], log=lines.append, role=TEACHER)
    pool.take_out(A, "/health_generate: connection refused")
    with pytest.raises(NoTeacherLeft, match="no live teacher server left") as e:
        pool.input_log_probs([1, 2, 3], 1)
    assert f"{A}: out (/health_generate: connection refused)" in str(e.value)
    assert pool.status(A) == OUT
    pool.rejoin(A, "restarted in 31 s")
    assert pool.status(A) == LIVE  # no weight sync to wait for
    assert lines == [f"teacher server {A} taken out of service: /health_generate: connection refused (0 of 1 live)",
                     f"teacher server {A} restarted in 31 s: back in service"]
    assert pool.pop_health_metrics() == {"distill/teachers_live": 1.0, "distill/teacher_failures": 1.0,
                                         "distill/teacher_restarts": 0.0,
                                         "distill/teacher_requests_resubmitted": 0.0}
    pool.close()
