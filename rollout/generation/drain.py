"""The end of a rollout step's generation: abort what is still in flight and wait for it, bounded.

    drain(pool, in_flight, timeout_s, abandon)   # in_flight: {Future: Sample} of generate calls

Used by rollout.generation.manager.RolloutManager.generate_step after its step is full, stopped (a signal) or
out of servers, and by the asynchronous rollout thread's pauses for a weight sync.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

from rollout.generation.sample import ABORTED, Sample

if TYPE_CHECKING:
    from rollout.servers.pool import ServerPool


def drain(pool: ServerPool, in_flight: dict[Future, Sample], timeout_s: float, abandon: threading.Event) -> None:
    """Abort every request on the pool's servers (again while some are still running: a request
    may reach a server after the previous abort) and wait for the calls. What has not returned
    within timeout_s (a stalled server) is abandoned: `abandon` (given to each ServerPool.generate)
    ends its wait, its sample is marked ABORTED and goes back unfinished, and a late answer goes
    nowhere. So a stop (a signal) never waits for the health probe or the request's own timeout.
    The abort runs beside the wait: a stalled server holds it up to its HTTP timeout."""
    deadline = time.monotonic() + timeout_s
    aborting: threading.Thread | None = None
    try:
        while in_flight:
            if aborting is None or not aborting.is_alive():
                thread = threading.Thread(target=_abort_all, args=(pool,), daemon=True,
                                          name="rollout-abort")
                thread.start()
                # kept only once started: a signal's exception inside start() would otherwise
                # leave the finally's join() raising "cannot join thread before it is started"
                # in place of the signal's exit (the second-signal test met it)
                aborting = thread
            done, _ = wait(list(in_flight), timeout=1.0)
            for f in done:
                sample = in_flight.pop(f)
                if f.exception() is not None:
                    sample.status = ABORTED
            if time.monotonic() > deadline:
                abandon.set()
    finally:
        abandon.clear()
        if aborting is not None:  # an abort that outlived the drain would abort the next step's
            aborting.join(timeout=2.0)  # requests (a healthy server answers in ms; a stalled one is out)


def _abort_all(pool: ServerPool) -> None:
    try:
        pool.abort_all()
    except Exception:  # noqa: BLE001 - a dead server has nothing left to abort
        pass
