"""A run owns its folders: one lock file per folder, held while the run lives.

    lock = RunLock.acquire(Path("/runs/a/ck"), field="checkpoint.dir")   # RunLockedError if taken
    ...
    lock.release()

Before this, two runs on one checkpoint.dir both exited 0, with every step twice in metrics.jsonl
and both writing the same checkpoints and sync folder.

The mechanism, chosen to work on the shared filesystems Slurm clusters use (NFS v3/v4, Lustre,
GPFS), where flock/fcntl locks may be local to a node or not enforced:
- Taking the lock is an exclusive create, `open(LOCK, O_CREAT | O_EXCL)`, which is atomic on a
  local disk, on NFS v3 and later (the server decides) and on Lustre. The file holds the holder:
  host, pid, the process's start time, Slurm job id and step, and when it started.
- The holder proves it lives by a heartbeat: a thread touches the file every HEARTBEAT_S seconds.
- A lock is stale, and is taken over, when
  * its holder is on this host and its process is gone (pid and start time: a reused pid is
    another process), or
  * its holder is an earlier attempt of this same Slurm job (a requeue keeps the job id, and
    Slurm starts a new attempt only after the old one's steps have ended), or
  * its heartbeat is older than STALE_S seconds, measured on the filesystem's own clock (the
    mtime of a file created there now), so clocks of other nodes do not matter. STALE_S is well
    above NFS's attribute cache (acregmax, 60 s by default).
  Otherwise the second run stops at once with one line naming the holder. A run killed on
  another node of another job blocks the folder for up to STALE_S seconds: the line says when
  the lock goes stale.
- A takeover renames the stale file to a unique name first (only one of two racing runs can),
  then creates the lock exclusively again; the loser of the race sees a live lock.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gspo_errors import InputError

LOCK_NAME = "gspo.lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0


class RunLockedError(InputError, RuntimeError):
    """Another run holds the folder; the message names the holder and what to do."""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex}


def _describe(holder: dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('started')}"


def _fs_now(folder: Path) -> float:
    """The filesystem's clock: the mtime of a file created in `folder` now."""
    probe = folder / f".{LOCK_NAME}.clock-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime
    finally:
        probe.unlink(missing_ok=True)


def stale_reason(lock: Path, holder: dict[str, Any]) -> str | None:
    """Why the lock at `lock` (holding `holder`) no longer belongs to a live run, or None."""
    me = _me()
    if holder.get("host") == me["host"]:
        pid = holder.get("pid")
        start = _process_start(pid) if isinstance(pid, int) else None
        if start is None or (holder.get("pid_start") and start != holder["pid_start"]):
            return f"its process {pid} on this host is gone"
        return None
    if holder.get("slurm_job_id") and holder["slurm_job_id"] == me["slurm_job_id"]:
        return f"it was taken by an earlier attempt of this Slurm job ({me['slurm_job_id']})"
    try:
        age = _fs_now(lock.parent) - lock.stat().st_mtime
    except FileNotFoundError:
        return "it was released meanwhile"
    if age > STALE_S:
        return f"its heartbeat stopped {age:.0f} s ago"
    return None


def _locked(folder: Path, field: str, holder: dict[str, Any]) -> RunLockedError:
    return RunLockedError(
        f"{field}={str(folder)!r} is in use by another run ({_describe(holder)}; lock file "
        f"{folder / LOCK_NAME}); wait for it to end or use another {field}. A lock left by a killed "
        f"run is taken over once its heartbeat is {STALE_S:.0f} s old (at once on the same host or "
        "in the same Slurm job)")


def check_unlocked(folder: str | Path, field: str) -> None:
    """RunLockedError if a live run holds `folder`; a look that takes nothing and writes nothing
    where the holder is on this host. The start-up checks call it before torch is imported, so a
    second run stops in about a second; RunLock.acquire, later, is what decides."""
    folder = Path(folder)
    holder = _read(folder / LOCK_NAME)
    if holder is None:
        return
    try:
        why = stale_reason(folder / LOCK_NAME, holder)
    except OSError:  # the clock probe in a folder we cannot write: acquire (after the checks) says
        return
    if why is None:
        raise _locked(folder, field, holder)


class RunLock:
    """The lock of one folder, held by this process (see the module docstring)."""

    def __init__(self, path: Path, field: str, holder: dict[str, Any]) -> None:
        self.path, self.field, self.holder = path, field, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"run-lock {path}", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, folder: str | Path, field: str) -> "RunLock":
        """Take `folder`'s lock (creating the folder), or raise RunLockedError naming the holder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_NAME
        me = _me()
        why: str | None
        for _ in range(5):  # a few rounds only when racing others over a stale lock
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(path)
                if holder is None:  # released, or being written this instant: look again, unless
                    if _age(path) < 5.0:  # it stayed empty (a holder killed while writing it)
                        time.sleep(0.2)
                        continue
                    holder, why = {}, "it is empty or unreadable"
                else:
                    why = stale_reason(path, holder)
                if why is None:
                    raise _locked(folder, field, holder) from None
                print(f"[gspo] taking over the lock of {folder}: {why} ({_describe(holder)})", flush=True)
                try:  # only one racer can rename it away
                    os.rename(path, path.with_name(f"{LOCK_NAME}.stale-{me['token']}"))
                    path.with_name(f"{LOCK_NAME}.stale-{me['token']}").unlink(missing_ok=True)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            return cls(path, field, me)
        raise RunLockedError(f"{field}={str(folder)!r}: could not take its lock {path} (other runs "
                             "keep taking it); is another run starting there?")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (_read(self.path) or {}).get("token") != self.holder["token"]:
                    return  # taken over (we were thought dead): nothing of ours to keep fresh
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Give the folder back (only if the lock is still ours)."""
        self._stop.set()
        try:
            if (_read(self.path) or {}).get("token") == self.holder["token"]:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _age(path: Path) -> float:
    try:
        return _fs_now(path.parent) - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
