"""The code sandbox's start-up line (run.py): which backend runs the programs, what it isolates and
what it leaves open on this machine, said once when a run starts (docs/rewards.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from rollout.rewards.sandbox.cgroup import CgroupLayout
from rollout.rewards.settings import CodeSandboxSettings


class SandboxFacts(Protocol):
    """What the line reads of a probed sandbox (run.py's Sandbox)."""

    mode: str | None
    python: str | None
    settings: CodeSandboxSettings
    cgroups: CgroupLayout | None
    syscall_filter: bytes | None
    uid: int | None
    whole_system: bool
    fallback: str
    landlock: int


def start_line(sandbox: SandboxFacts, fallback_processes: int) -> str:
    """The sandbox's start-up line (its mode, what it isolates, what it leaves open, its bounds)."""
    if sandbox.mode == "gvisor":
        bounds = (sandbox.cgroups.describe().replace(" per test ", " per response (its whole gVisor sandbox) ")
                  if sandbox.cgroups else "no cgroup here")
        return (f"code sandbox: gVisor (runsc, ptrace platform: a kernel of its own per response, not the "
                f"host's; no network, the interpreter's files read-only, a private /tmp), {bounds}, {sandbox.python}")
    if sandbox.cgroups is not None:
        bounds = sandbox.cgroups.describe()
    else:
        bounds = (f"no cgroup here: memory bounded per process, at most {min(sandbox.settings.max_processes, fallback_processes)} processes, "
                  "memfd, SysV IPC and unix sockets refused, and the pages a run reads stay cached "
                  "after it (a later run can time them)")
    if sandbox.syscall_filter is None:
        bounds += f"; no system-call filter on {os.uname().machine}"
    user = f"as uid {sandbox.uid}" if sandbox.uid is not None else (
        "as the worker's user, whose per-user budgets (pipe pages, processes) the runs share with it")
    if sandbox.mode == "namespaces":
        files = ("the system's directories whole (the loader listed no libraries)" if sandbox.whole_system
                 else "the interpreter's files only")
        fallback = (f"; gVisor does not run here ({sandbox.fallback}), so the kernel is the host's: what it "
                    "shares between runs is open (pipe and socket inode numbers, the host's caches' timing)"
                    if sandbox.fallback else "")
        return (f"code sandbox: namespaces (a read-only root of {files}, no network, private /tmp, IPC and "
                f"hostname, no nested user namespaces, {user}), {bounds}, {sandbox.python}{fallback}")
    if sandbox.landlock:
        files = (f"files confined by Landlock (ABI {sandbox.landlock}: reads of the interpreter's files, "
                 "writes in its folder)")
    elif sandbox.uid is not None:
        files = ("NO file-system isolation (no Landlock in this kernel; what its user leaves in /tmp, "
                 "/var/tmp and /dev/shm is removed)")
    else:
        files = ("NO file-system isolation (no Landlock in this kernel: the user's files, and the /proc "
                 "files of its processes, the trainer's oom_score_adj among them, open to the runs)")
    return (f"code sandbox: process isolation only (rollout.reward_args.isolation: process): the host's "
            f"processes visible, sockets refused, {user}, {files}, {bounds}, {sandbox.python}")


def userns_hint() -> str:
    """Why user namespaces cannot be made, where the machine says (for the refusal's line)."""
    try:
        n = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        return ""
    return " (user namespaces are disabled on this machine: /proc/sys/user/max_user_namespaces = 0)" if n == 0 else ""
