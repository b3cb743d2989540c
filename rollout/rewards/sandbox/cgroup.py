"""A cgroup per sandboxed run: memory (its tmpfs files, shared memory and memfd included),
processes and CPU bounded for the whole test, not per process (RLIMIT_AS and RLIMIT_NPROC are
per process and per user: 32 processes x memory_mb is more than a node has).

    layout = CgroupLayout.find()             # once per sandbox; None where no cgroup can be made
    run = layout.create(memory_bytes=1 << 30, tasks=33)
    subprocess.Popen(..., preexec_fn=run.join)   # the run's first process joins before its exec
    pids = run.remove()                      # kills what is left, empties its memory, removes it
    # or run.kill(), the run's files removed, then run.release()

Where, first that works (each tried by making and removing a cgroup):
- cgroup v2, delegated: this process's cgroup, or its parent (the layout of Slurm's
  `step/user/task_N` and of systemd's delegated units), with memory and pids in its
  cgroup.subtree_control and writable by this user. A cgroup holding processes cannot enable
  controllers for its children, so the worker's own leaf works only when it is a domain already
  set up that way; the sibling layout is the common one.
- cgroup v1: the memory and pids hierarchies (and cpu where mounted), a child of this process's
  cgroup in each (root on most machines; these machines: memory, pids and cpu, writable by root).
- else None: the sandbox refuses memory outside RLIMIT_AS with seccomp and lowers the process
  count instead (run.py).
A run's cgroup is named `gspo-sandbox-<worker pid>-<n>`; one left by a worker that was killed is
removed by the next sandbox that finds the layout.

Its memory is emptied before it is removed: page cache a run brought in (a file no one had cached)
stays charged to its cgroup after the run, and a removed cgroup lives on, pinned, until those
pages are evicted (87 -> 118 cgroups after 30 runs that each read a cold file; at the kernel's
65,535 no cgroup can be made), while the pages tell a later run what this one read (a channel
between runs: interpreter_files.py). v1: memory.force_empty; v2: memory.reclaim (5.19+), else
memory.max 0; always, since what reclaim frees besides pages (negative dentries) is a channel
too (~1 ms; the honest run's files are the worker's, cached before). Standard library only.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time
from pathlib import Path

PREFIX = "gspo-sandbox"
_NAMES = itertools.count()
"""Run numbers, one sequence per process (any number of sandboxes in it)."""
CPU_PERIOD_US = 100_000
REMOVE_WAIT_S = 2.0
"""How long remove() waits for the run's processes to be gone (a PID namespace dies asynchronously)."""
EMPTY_WAIT_S = 0.5
"""How long release() tries again to evict the pages a run's cgroup still holds (_empty_memory)."""


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root within its hierarchy, mount point, fstype, super options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                point = fields[4].encode().decode("unicode_escape")
                out.append((fields[3], point, tail[0], set(tail[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _on_disk(point: str, root: str, path: str) -> Path:
    rel = os.path.relpath(path, root) if (path + "/").startswith(root.rstrip("/") + "/") else path.lstrip("/")
    return Path(point) / ("" if rel == "." else rel)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _members(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


@dataclasses.dataclass
class RunCgroup:
    """One run's cgroup (a directory per hierarchy in v1, one in v2)."""

    version: int
    dirs: list[Path]

    def join(self) -> None:
        """Move the calling process in (the run's first process, between its fork and exec)."""
        # v1: the calling thread through `tasks` (it is the whole process, fresh from fork), which
        # skips the lock on every thread group that moving by cgroup.procs takes (an RCU grace
        # period, ~10 ms a run here)
        for d in self.dirs:
            _write(d / ("tasks" if self.version == 1 else "cgroup.procs"), "0")

    def kill(self) -> set[int]:
        """SIGKILL what is left in it (a child that escaped its process group) and wait until it is
        gone; returns every pid seen in it (the caller reaps those it adopted)."""
        seen: set[int] = set()
        if not self.dirs:
            return seen
        kill = self.dirs[0] / "cgroup.kill"
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            pids = _members(self.dirs[0])
            seen.update(pids)
            if not pids or time.monotonic() > deadline:
                return seen
            try:
                _write(kill, "1")
            except OSError:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            time.sleep(0.002)

    def lingering(self) -> int:
        """Tasks still counted against its pids limit: its processes, and the zombies among them no
        one has reaped (a zombie leaves the cgroup's member list at its exit, not its count)."""
        for d in self.dirs:
            try:
                return int((d / "pids.current").read_text())
            except (OSError, ValueError):
                continue
        return 0

    def remove(self) -> set[int]:
        """kill(), then release(); the pids kill() saw."""
        seen = self.kill()
        self.release()
        return seen

    def release(self) -> None:
        """Empty its memory (module docstring) and remove it, once kill() found it empty."""
        for d in self.dirs:
            _empty_memory(d, self.version)
            try:
                d.rmdir()
            except OSError:
                pass  # still busy: the next sandbox that finds the layout removes it


def _memory_stat(d: Path) -> dict[str, int]:
    try:
        lines = (d / "memory.stat").read_text().splitlines()
    except OSError:
        return {}
    return {name: int(value) for name, _, value in (line.partition(" ") for line in lines) if value.isdigit()}


def _cached_file_pages(d: Path, version: int) -> int:
    """Bytes of files' page cache charged to the cgroup: tmpfs and shared memory left out, which
    reclaim cannot evict (a run's tmpfs is gone with its mount or its folder)."""
    stat = _memory_stat(d)
    return stat.get("cache" if version == 1 else "file", 0) - stat.get("shmem", 0)


def _empty_memory(d: Path, version: int) -> None:
    """Evict what is charged to a cgroup whose processes are gone (module docstring): its page
    cache and the kernel objects reclaim frees with it (dentries: a lookup of a missing name in a
    bound host directory leaves a negative one, 100,000 from one run, which would outlive it in
    the parent cgroup and answer a later run's lookup faster). Always, whatever memory.stat says
    of file pages (a run that reads nothing still leaves dentries). A directory of another
    controller has no memory.stat and is left as it is. Not while pages are dirty (a file the run
    wrote outside a tmpfs and nobody removed): reclaim does not write them back but waits on them,
    100 ms at a time; the cgroup is then left pinned until they are."""
    if not (d / "memory.stat").exists():
        return
    stat = _memory_stat(d)
    if stat.get("dirty" if version == 1 else "file_dirty", 0):
        return
    # One pass can leave pages it could not take yet: a page still locked by the read-ahead that the
    # run's last read started (v1's mem_cgroup_force_empty gives up after a few passes without
    # progress and still answers 0; v2's memory.reclaim answers EAGAIN). On a loaded host those
    # pages, left in the parent, told a later run what this one read: tried again, a bounded while.
    deadline = time.monotonic() + EMPTY_WAIT_S
    while True:
        try:
            if version == 1:
                _write(d / "memory.force_empty", "0")
            elif (d / "memory.reclaim").exists():
                _write(d / "memory.reclaim", (d / "memory.current").read_text().strip())
            else:
                _write(d / "memory.max", "0")
        except OSError:
            pass  # EAGAIN: not all of it yet
        if not _cached_file_pages(d, version) or time.monotonic() > deadline:
            return  # past the deadline: a page another process has mapped pins it a while
        time.sleep(0.005)


@dataclasses.dataclass
class CgroupLayout:
    """Where this process may make a cgroup per run (module docstring)."""

    version: int
    parents: dict[str, Path]
    """v2: {"": the delegated cgroup}; v1: {"memory": ..., "pids": ..., and "cpu" if usable}."""
    cpu: bool
    """The CPU of a run is bounded too (v2: cpu in subtree_control; v1: a writable cpu hierarchy)."""

    def describe(self) -> str:
        what = "memory, processes" + (" and CPU" if self.cpu else "")
        where = ", ".join(str(p) for p in self.parents.values())
        return f"cgroup v{self.version} per test ({what}) under {where}"

    @classmethod
    def find(cls) -> "CgroupLayout | None":
        """The first layout that works here (module docstring), or None."""
        try:
            mounts, own = _mounts(), _own_cgroups()
        except OSError:
            return None
        for found in (cls._v2(mounts, own), cls._v1(mounts, own)):
            if found is not None and found._works():
                found._remove_stale()
                return found
        return None

    @classmethod
    def _v2(cls, mounts, own) -> "CgroupLayout | None":
        if "" not in own:
            return None
        for root, point, fstype, _ in mounts:
            if fstype != "cgroup2":
                continue
            here = _on_disk(point, root, own[""])
            for d in (here, here.parent):
                try:
                    enabled = set((d / "cgroup.subtree_control").read_text().split())
                except OSError:
                    continue
                if {"memory", "pids"} <= enabled and os.access(d, os.W_OK):
                    return cls(2, {"": d}, "cpu" in enabled)
        return None

    @classmethod
    def _v1(cls, mounts, own) -> "CgroupLayout | None":
        parents = {}
        for controller in ("memory", "pids", "cpu"):
            for root, point, fstype, options in mounts:
                if fstype == "cgroup" and controller in options and controller in own:
                    d = _on_disk(point, root, own[controller])
                    if os.access(d, os.W_OK):
                        parents[controller] = d
                    break
        if "memory" not in parents or "pids" not in parents:
            return None
        return cls(1, parents, "cpu" in parents)

    def _works(self) -> bool:
        try:
            self.create(memory_bytes=64 << 20, tasks=4).remove()
        except OSError:
            return False
        return True

    def _remove_stale(self) -> None:
        """Cgroups of workers that were killed mid-run (their name holds the worker's pid)."""
        for parent in self.parents.values():
            try:
                entries = list(parent.glob(f"{PREFIX}-*-*"))
            except OSError:
                continue
            for d in entries:
                try:
                    owner = int(d.name.split("-")[2])
                except (IndexError, ValueError):
                    continue
                if not _alive(owner):
                    RunCgroup(self.version, [d]).remove()

    def create(self, memory_bytes: int, tasks: int, cpus: float = 1.0) -> RunCgroup:
        """A fresh cgroup for one run: at most `memory_bytes` of memory (no swap), `tasks`
        processes and threads, `cpus` CPUs' worth of time where the CPU is bounded."""
        made: list[Path] = []
        while True:  # a name no run of this process left behind (one that could not be removed yet)
            name = f"{PREFIX}-{os.getpid()}-{next(_NAMES)}"
            if not any((p / name).exists() for p in self.parents.values()):
                break
        try:
            if self.version == 2:
                d = self.parents[""] / name
                d.mkdir()
                made.append(d)
                _write(d / "memory.max", str(memory_bytes))
                for knob, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if (d / knob).exists():
                        _write(d / knob, value)
                _write(d / "pids.max", str(tasks))
                if self.cpu:
                    _write(d / "cpu.max", f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            else:
                for controller, parent in self.parents.items():
                    d = parent / name
                    d.mkdir()
                    made.append(d)
                    if controller == "memory":
                        _write(d / "memory.limit_in_bytes", str(memory_bytes))
                        for knob, value in (("memory.memsw.limit_in_bytes", str(memory_bytes)),
                                            ("memory.swappiness", "0")):
                            if (d / knob).exists():
                                _write(d / knob, value)
                    elif controller == "pids":
                        _write(d / "pids.max", str(tasks))
                    else:
                        _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                        _write(d / "cpu.cfs_quota_us", str(int(cpus * CPU_PERIOD_US)))
        except OSError:
            RunCgroup(self.version, made).remove()
            raise
        return RunCgroup(self.version, made)
