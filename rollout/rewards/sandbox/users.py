"""The user a sandboxed run runs as, outside its namespaces (run.py, both isolation modes).

    uid = run_user()     # root: a user of this reward worker's own; else None (the worker's user)

A user per reward worker, as root, uid and gid RUN_UID_BASE + the worker's pid, with no entry in
/etc/passwd. The kernel counts much per user, across namespaces: inotify instances (128), pipe
pages (pipe-user-pages-soft, 64 MiB), processes, user namespaces, pending signals. With one user
for every run (nobody), one run held them all and a concurrent honest run that needed them failed
(1.0 -> 0.0); in process mode a run could also enter a concurrent run's folder and replace its
main.py between its write and the interpreter's read. A worker's runs are sequential, so one user
per worker keeps each budget, and each run's folder (0700), its own. A worker that is not root
cannot hand out users: its runs are its own user, and share that user's budgets with each other
and with the trainer (its start-up line says so).
"""
from __future__ import annotations

import os

RUN_UID_BASE = 0x7A000000
"""2046820352: systemd's plan leaves 1879048192-2147352575 unused (no user, no container range);
with the pid added, the range ends at 2051014656."""
PID_LIMIT = 1 << 22
"""The kernel's largest pid_max: the range of users is PID_LIMIT long."""


def run_user() -> int | None:
    """The uid (and gid) of this worker's runs when it is root, else None: they run as the worker."""
    return RUN_UID_BASE + os.getpid() if os.geteuid() == 0 else None


def worker_of(uid: int) -> int | None:
    """The pid of the worker whose runs are `uid`, or None for a user outside the range."""
    pid = uid - RUN_UID_BASE
    return pid if 0 < pid < PID_LIMIT else None
