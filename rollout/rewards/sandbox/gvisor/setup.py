"""Setting gVisor up for the code sandbox (sessions.py runs its sessions): Debian's runsc, installed on
first use as root, the OCI bundle a session boots from, and each worker's folder for them.

    runsc = ensure_runsc(log)                     # Debian's runsc, installed on first use as root
    bundle = Bundle.make(folder, python, plan)    # the OCI bundle: the interpreter's files, read-only
    folder = worker_folder()                      # this worker's bundle and runsc's state
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

RUNNER_SOURCE = (Path(__file__).parent / "runner.py").read_text()
RUNSC_PACKAGE = "runsc"
"""Debian's gVisor (bookworm: 0.0~20221219); `apt-get install runsc` on first use, as root."""
INSTALL_LIMIT_S = 300.0
CAPABILITIES = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE"]
"""The runner's, inside the sandbox (to start each program as its own user, end it and remove its folder); the
program has none."""

class GvisorUnavailable(RuntimeError):
    """gVisor cannot run here (no runsc and no way to install it, not root, the sandbox does not
    start); the message says why, for the start-up line of the fallback."""


def ensure_runsc(log: Callable[[str], None]) -> str:
    """The runsc binary; installs Debian's package first where it is missing and this is a root
    Debian machine (with one line on `log`, never silently), under a lock (several workers probe at
    once). GvisorUnavailable otherwise."""
    found = shutil.which("runsc")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise GvisorUnavailable("no runsc here (Debian's `runsc` package: apt-get install runsc, as root)")
    with open("/tmp/gspo-runsc-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = shutil.which("runsc")
        if found:
            return found
        log(f"code sandbox: installing Debian's {RUNSC_PACKAGE} (gVisor) for rollout.reward_args.isolation "
            "(first use on this machine: apt-get install, about 10-30 s)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        wait = ["-o", f"DPkg::Lock::Timeout={int(INSTALL_LIMIT_S / 2)}"]  # another apt-get at work (a test's Slurm)
        for argv in (["apt-get", *wait, "update", "-qq"],
                     ["apt-get", *wait, "install", "-y", "-qq", "--no-install-recommends", RUNSC_PACKAGE]):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_LIMIT_S, env=env)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise GvisorUnavailable(f"{' '.join(argv)}: {e}") from None
            if done.returncode != 0:
                raise GvisorUnavailable(f"{' '.join(argv)} failed: {' '.join(done.stderr.split())[-200:]}")
    found = shutil.which("runsc")
    if not found:
        raise GvisorUnavailable(f"apt-get installed {RUNSC_PACKAGE} but no runsc is on PATH")
    return found


@dataclasses.dataclass
class Bundle:
    """An OCI bundle: a read-only root holding the plan's links and mount points, and config.json
    binding the plan's files (interpreter_files.root_plan) read-only from the host."""

    path: Path

    @classmethod
    def make(cls, folder: Path, python: str, plan: list[list[str]], tmp_mb: int, shm_mb: int) -> "Bundle":
        rootfs = folder / "rootfs"
        mounts = [{"destination": "/proc", "type": "proc", "source": "proc"},
                  {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", f"size={tmp_mb}m", "mode=1777"]},
                  {"destination": "/dev/shm", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "noexec", f"size={shm_mb}m", "mode=1777"]}]
        for entry in plan:
            kind, path, dest = entry[0], entry[1], rootfs / entry[1].lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if kind == "link":
                os.symlink(entry[2], dest)
            elif kind == "dir":
                dest.mkdir(exist_ok=True)
                mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind", "ro"]})
            elif kind == "file":  # gVisor's own /dev: the "dev" entries are its device nodes
                dest.touch()
                mounts.append({"destination": path, "type": "bind", "source": path, "options": ["bind", "ro"]})
        (rootfs / "etc").mkdir(exist_ok=True)
        (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/tmp:/usr/sbin/nologin\n"
                                               "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        for point in ("proc", "tmp", "dev"):
            (rootfs / point).mkdir(exist_ok=True)
        caps = {k: CAPABILITIES for k in ("bounding", "effective", "permitted")}
        config = {"ociVersion": "1.0.2", "hostname": "sandbox", "root": {"path": "rootfs", "readonly": True},
                  "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "cwd": "/", "noNewPrivileges": True,
                              "args": [python, "-I", "-S", "-c", RUNNER_SOURCE],
                              "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "capabilities": caps},
                  "mounts": mounts,
                  "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]}}
        (folder / "config.json").write_text(json.dumps(config))
        return cls(folder)


def runsc_argv(runsc: str, state: Path) -> list[str]:
    """runsc's global flags: its own network stack with no interface but loopback, the ptrace
    platform, the caller's cgroup (the session's, joined before the exec) instead of runsc's."""
    return [runsc, f"--root={state}", "--network=none", "--platform=ptrace", "--ignore-cgroups"]


FOLDER_PREFIX = "gspo-runsc-"


def worker_folder() -> Path:
    """This worker's bundle and runsc's state for its sessions, in the host's temporary directory;
    those of workers that were killed (their pid in the name) are removed first."""
    for stale in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        try:
            pid = int(stale.name[len(FOLDER_PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, OSError):
            pass
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
