"""Run a function on N real processes joined in a gloo process group (the tests' launcher).

    results = run_distributed(fn, world_size=4, args=(...), timeout=300)

`fn(rank, world_size, *args)` runs in a fresh spawned process with torch.distributed already
initialised (gloo, env:// rendezvous on a free loopback port); its return value comes back in rank
order. It is serialised with torch.save in the rank (tensors are copied, not shared-memory handles
that die with the rank's process); a value that cannot be serialised fails the call at once. An exception on any rank fails the call with that rank's
traceback; a rank that hangs past `timeout` fails it too and every rank is killed, so a broken
collective never hangs the suite.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch

from rollout.servers.ports import free_port  # noqa: F401  (the tests' rendezvous and server ports)


def _worker(fn, rank, world_size, port, args, results, env) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # Several ranks share 2 cores: one thread each avoids oversubscription (and keeps results
    # independent of the core count).
    torch.set_num_threads(1)
    # Before `fn` imports megatron-core (many do so first): without CUDA its fusions then compile
    # on first use instead of importing TorchDynamo and Inductor, 3-5 s of CPU per rank
    # (model_specs/lazy_compile.py).
    from model_specs import lazy_compile
    lazy_compile.install()
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RankDied(RuntimeError):
    """Ranks that ended without a result (exit codes), with the results of the others that gave
    one within `after_death` seconds of the first death (the rest are killed), and the tracebacks
    of those that failed because of it (a collective with the dead rank: gloo's "Connection closed
    by peer")."""

    def __init__(self, exit_codes: dict[int, int], results: dict[int, Any],
                 failures: dict[int, str] | None = None):
        super().__init__(f"ranks {sorted(exit_codes)} died (exit codes {exit_codes})")
        self.exit_codes, self.results, self.failures = exit_codes, results, failures or {}


def _dead(procs, skip) -> dict[int, int]:
    return {r: p.exitcode for r, p in enumerate(procs) if r not in skip and p.exitcode not in (None, 0)}


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
                    timeout: float = 300.0, env: dict[str, str] | None = None,
                    after_death: float = 60.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, child_env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    died: dict[int, int] = {}  # rank -> exit code, for a rank that ended without a result
    failed: dict[int, str] = {}  # rank -> traceback, for a rank that failed after a death
    deadline = time.monotonic() + timeout
    given_up = False  # the ranks still running wait on a dead one: killed without a grace period
    try:
        while len(out) + len(died) + len(failed) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                # a rank that reported exits 0 (its result may still be in the pipe)
                for r, code in _dead(procs, set(out) | set(died) | set(failed)).items():
                    died[r] = code  # killed (SIGKILL: -9), or crashed
                    deadline = min(deadline, time.monotonic() + after_death)
                if died and time.monotonic() > deadline:
                    given_up = True
                    break  # the others wait on the dead rank (gloo has no timeout here)
                if not died and time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out) - set(died))
                    raise TimeoutError(f"ranks {missing} of {world_size} gave no result within "
                                       f"{timeout} s (a hung collective?)") from None
                continue
            if not ok:
                # a failure caused by another rank's death: a killed rank is reaped within moments
                wait_until = time.monotonic() + 2.0
                while True:
                    died.update(_dead(procs, set(out) | set(failed) | {rank}))
                    if died or time.monotonic() >= wait_until:
                        break
                    time.sleep(0.05)
                if not died:
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
                failed[rank] = value
                deadline = min(deadline, time.monotonic() + after_death)
                continue
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if died:
            raise RankDied(died, out, failed)
    finally:
        for p in procs:
            p.join(timeout=0 if given_up else 10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


def gather_row_values(parts: list[tuple[Any, Any] | None], rows: int, seq: int) -> torch.Tensor:
    """Per-rank `(row indices, values [n, <=seq])` pieces (None from ranks that hold none, e.g.
    earlier pipeline stages), as numpy arrays, placed into one `[rows, seq]` tensor; NaN where no
    rank reported."""
    out = torch.full((rows, seq), float("nan"))
    for part in parts:
        if part is not None:
            idx, values = part
            out[torch.from_numpy(idx), : values.shape[1]] = torch.from_numpy(values)
    return out
