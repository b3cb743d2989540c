"""Process mode's own pieces (run.py, `isolation: process`): what confines a run's files, and
removing what it leaves.

    abi = landlock_abi()             # the kernel's Landlock version, 0 where it has none
    remove_folder(path, until)       # the run's folder, waited for until `until` at most
    remove_left_behind(uid, until)   # root without Landlock: what the run's user left in the host's temp dirs
    remove_stale_folders(until)      # root: the folders of runs whose worker was killed in the middle

The run's user is the worker's own as root (users.py), so its folder (0700) is its own.

Files: where the kernel has Landlock (5.13+, with the LSM enabled), first_process.py lets the program
read only what the namespaces mode's root holds (interpreter_files.py: the interpreter, its import
path, the shared libraries they load, five device nodes) and /proc, and write only beneath its own
folder. Without it, a root worker removes what the run's user left at the top of the host's temp
directories (HOST_TEMP_DIRS) after each run, and RLIMIT_FSIZE bounds each file written elsewhere; a
worker that is not root can do neither (docs/rewards.md).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time
from pathlib import Path

from rollout.rewards.sandbox.users import worker_of

HOST_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
"""World-writable directories of every Linux host: where a run without Landlock leaves files."""
FOLDER_PREFIX = "gspo-sandbox-"
LANDLOCK_CREATE_RULESET = 444
"""The same number on every architecture (asm-generic); flag 1 asks for the ABI version."""


def landlock_abi() -> int:
    """The Landlock ABI version of this kernel, 0 where it has none (or it is disabled)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        version = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                               ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(0, version)


def remove_folder(path: str, until: float) -> bool:
    """Remove the run's folder, waiting until `until` (time.monotonic()) at most: the 177k files a
    program makes in 3.5 s take 2.2 s to remove, outside its time limit, so the wait is part of the
    caller's deadline; past it the removal goes on in the background. Whether it finished."""
    return _within(until, shutil.rmtree, path, ignore_errors=True)


def remove_left_behind(uid: int, until: float, keep: str = "") -> bool:
    """Remove what `uid` owns at the top of HOST_TEMP_DIRS but `keep` (root, where Landlock does not
    confine the program's writes), waiting until `until` at most, as remove_folder does. A removed
    directory's symbolic links are not followed (shutil.rmtree's descriptor-based walk)."""
    return _within(until, _remove_owned, uid, keep)


def remove_stale_folders(until: float) -> bool:
    """Root: remove the folders of runs whose reward worker was killed in the middle (at a reward
    timeout); the folder's owner names the worker (users.worker_of). As remove_folder."""
    return _within(until, _remove_stale)


def _remove_stale() -> None:
    for folder in Path("/tmp").glob(f"{FOLDER_PREFIX}*"):
        try:
            worker = worker_of(folder.lstat().st_uid)
            if folder.is_symlink() or worker is None or worker == os.getpid():
                continue
            os.kill(worker, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def _remove_owned(uid: int, keep: str) -> None:
    for top in HOST_TEMP_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.path == keep or entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _within(until: float, work, *args, **kwargs) -> bool:
    thread = threading.Thread(target=work, args=args, kwargs=kwargs, name="sandbox-removal", daemon=True)
    thread.start()
    thread.join(None if until == float("inf") else max(0.0, until - time.monotonic()))
    return not thread.is_alive()
