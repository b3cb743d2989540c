"""The reward worker as the subreaper of its sandboxed runs, the reaping of what it adopts, and how a
run's first process starts (dying with the worker, in the run's cgroup) and is killed with its group.

    with adopting():              # orphans of the run come to this process, not to PID 1
        ...run, kill...
        left = reap(pids, group, until)

A run killed at its time or output limit loses its first process's parent at once (namespaces:
`unshare`, killed with its process group, before it could reap the PID namespace's first
process; process mode: the program, whose children outlive it for a moment). Such orphans went
to the nearest subreaper or to PID 1 and stayed zombies where that never reaps: 2 of 3 looping
responses left one, where the trainer is a container's first process. While a run lives, this
process is a subreaper (PR_SET_CHILD_SUBREAPER, counted across the threads that run sandboxes,
so it is one only while some run lives); after the run it reaps the run's processes it adopted,
by pid and by the run's process group, never another child of this process.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.rewards.sandbox.cgroup import RunCgroup

PR_SET_CHILD_SUBREAPER = 36
_lock = threading.Lock()
_runs = 0


def _subreaper(on: bool) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


@contextlib.contextmanager
def adopting() -> Iterator[None]:
    """This process is a subreaper while any run of it lives (module docstring)."""
    global _runs
    with _lock:
        if _runs == 0:
            _subreaper(True)
        _runs += 1
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                _subreaper(False)


def _stat(pid: int | str) -> list[bytes]:
    """/proc/<pid>/stat's fields after the command: [state, ppid, pgrp, session, ...]; [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (0 if it is gone)."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def children_of(parent: int) -> list[int]:
    """The processes whose parent is `parent` (a scan of /proc: its `children` file needs
    CONFIG_PROC_CHILDREN, which not every kernel has)."""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and len(fields := _stat(name)) > 1 and int(fields[1]) == parent]


def adopted_since(ticks: int) -> list[int]:
    """Children of this process that a run left it: started at or after `ticks` (the run's first
    process's start) in a session other than this process's (a run's processes are in the session
    its first process began, or one they began themselves). Found where a run's cgroup still
    counts tasks its member list no longer shows: zombies its first process left when it exited,
    outside its process group (a child that called setsid and exited)."""
    me, session = os.getpid(), os.getsid(0)
    out = []
    for pid in children_of(me):
        fields = _stat(pid)
        if len(fields) > 19 and int(fields[3]) != session and int(fields[19]) >= ticks:
            out.append(pid)
    return out


def reap(pids: set[int], group: int, until: float) -> set[int]:
    """Reap the run's processes this process adopted: any zombie child in the run's process
    group `group`, and each of `pids` once it is a zombie child of this process; a pid that is no
    child and no longer exists was reaped inside its PID namespace or by its own parent. Waits
    until `until` (time.monotonic()) at most for those still exiting; returns the pids left, for a
    later call."""
    left = set(pids)
    while True:
        while True:  # the group first: an adopted zombie whose pid was never seen
            try:
                found = os.waitid(os.P_PGID, group, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                break
            if found is None:
                break
            left.discard(found.si_pid)
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                if not os.path.exists(f"/proc/{pid}"):
                    left.discard(pid)
                continue
            if done:
                left.discard(pid)
        if not left or time.monotonic() >= until:
            return left
        time.sleep(0.002)


# --- a run's processes: started tied to the worker and its cgroup, killed as a group --------------
def die_with_worker() -> None:
    """In the child before exec: SIGKILL when the reward worker dies (then `unshare --kill-child`
    takes the whole PID namespace with it)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def in_child(cgroup: RunCgroup | None) -> Callable[[], None]:
    """What the run's first process does between fork and exec: die with the worker, join the
    run's cgroup (before anything of the program runs, so nothing it starts is outside it)."""
    def child() -> None:
        die_with_worker()
        if cgroup is not None:
            cgroup.join()
    return child


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (with namespaces, unshare's death takes its PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    proc.wait()
