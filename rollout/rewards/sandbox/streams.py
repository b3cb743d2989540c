"""A sandboxed run's streams (run.py): its stdin fed, its stdout read up to the cap (the program is
killed past it), the tail of its stderr, and the set-up's status line, at which the program's
clock starts (the sandbox's own set-up is not the program's time)."""
from __future__ import annotations

import os
import select
import subprocess
import time

SET_UP_LIMIT_S = 10.0
"""Bound on the sandbox's own set-up (namespaces, mounts), before the program's clock starts."""
STDERR_TAIL = 4096


def communicate(proc: subprocess.Popen, stdin: bytes, status_r: int, limit_s: float, hard: float,
                cap: int) -> tuple[bytes, bytes, str, bool, bool]:
    """Feed stdin, read stdout (up to `cap` bytes) and stderr (tail) until exit, the cap, `limit_s`
    after the set-up said "ok" (SET_UP_LIMIT_S before it), or `hard` (time.monotonic()), whichever
    comes first. Returns (stdout, stderr, the status line, past the cap, timed out)."""
    if proc.stdin is None or proc.stdout is None or proc.stderr is None:
        raise ValueError("communicate needs a process started with stdin, stdout and stderr as pipes")
    proc_in, proc_out, proc_err = proc.stdin, proc.stdout, proc.stderr
    out, err, status = bytearray(), bytearray(), bytearray()
    pending = memoryview(stdin)
    readers = {proc_out.fileno(): out, proc_err.fileno(): err, status_r: status}
    for fd in readers:
        os.set_blocking(fd, False)
    writer: int | None = proc_in.fileno()
    os.set_blocking(proc_in.fileno(), False)
    if not pending:
        proc_in.close()
        writer = None
    overflow = timed_out = False
    deadline, started = min(time.monotonic() + SET_UP_LIMIT_S, hard), False
    while readers or writer is not None:
        if not started and status.endswith(b"\n"):
            # the program's clock starts at its exec
            deadline, started = min(time.monotonic() + limit_s, hard), True
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        r, w, _ = select.select(list(readers), [writer] if writer is not None else [], [], left)
        if w and writer is not None:
            try:
                pending = pending[os.write(writer, pending[:65536]):]
            except (BrokenPipeError, BlockingIOError):
                pending = pending[len(pending):]
            if not pending:
                proc_in.close()
                writer = None
        for fd in r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                del readers[fd]
                continue
            buf = readers[fd]
            buf += chunk
            if fd == proc_err.fileno() and len(buf) > 4 * STDERR_TAIL:
                del buf[:-STDERR_TAIL]
            if fd == proc_out.fileno() and len(buf) > cap:
                overflow = True
        if overflow:
            break
    if not (overflow or timed_out):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return bytes(out[:cap]), bytes(err), status.decode(errors="replace"), overflow, timed_out
