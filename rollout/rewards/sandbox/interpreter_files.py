"""What a sandboxed run may read: the interpreter, its import path and the shared libraries they
load, and nothing else of the host's files (the namespaces mode's root, process mode's Landlock
reads); and keeping those files cached by the worker.

    plan, whole = root_plan("/usr/bin/python3.11")  # ["dir" | "file" | "link" | "dev", path(, target)]
    warm(plan)                                      # their pages read ahead, charged to this worker

Why not all of /usr: gigabytes of cold pages (JDK modules, toolchains) are a channel between runs
through the host's page cache. One run reads pages; a later one tests which are cached
(preadv2's RWF_NOWAIT, and without it the time of a read or a major fault), and a program with
no task logic scored 1.0 right after a sibling that solved the row and published its answers so.
The channel is closed at its root in three parts: a run's memory cgroup is emptied when it ends,
so the pages it brought into the cache leave with it (cgroup.py); the system-call filter refuses
the ways to test a page without reading it (seccomp.py); and what is left for a run to read is
the interpreter's files, which `warm` has cached already, charged to the worker's own cgroup, so
that a run finds no cold page of them to mark (and its honest imports cost no disk read).

How the plan is found: the interpreter, run outside the sandbox with the same `-I` flag, names
its import path (sys.path: the standard library, lib-dynload, the site directories); the dynamic
loader, in its list mode (glibc's LD_TRACE_LOADED_OBJECTS: objects mapped, no code run), names the
shared libraries that the interpreter and the standard library's extension modules load, with
libgcc_s (which glibc opens for a thread's cancellation). Every symbolic link met on the way to
each is recreated (/lib -> usr/lib, libz.so.1 -> libz.so.1.2.13), so each name resolves inside as
outside. A third-party extension module in a site directory that needs another system library
does not import. Where the loader lists nothing (a C library that is not glibc), the system's
directories are bound whole, as `whole` says (and the start-up line).
"""
from __future__ import annotations

import json
import os
import subprocess

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Top-level directories of the system (merged-usr links to /usr on most distributions)."""
DEVICES = ("null", "zero", "full", "random", "urandom")
ALWAYS_LOADED = ("libgcc_s.so.1",)
"""Libraries glibc opens at run time (pthread_cancel, pthread_exit): in the list by name."""
WARM_LIMIT_BYTES = 1 << 30
"""What warm() reads ahead at most: an interpreter whose site directories hold a GPU framework
has gigabytes there; past the limit, a run that imports them reads them itself, charged to its
cgroup, and again in every run (slower, not less isolated)."""
ASK_LIMIT_S = 20.0
"""Bound on asking the interpreter and the loader (a cold disk at start)."""
IMPORT_PATH = "import json, sys; print(json.dumps([p for p in sys.path if p]))"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def root_plan(python: str) -> tuple[list[list[str]], bool]:
    """What a run may read (module docstring) as entries for first_process.build_root and
    confine_files: ["dir", path] bound read-only, ["file", path] a host file bound onto an empty
    one, ["link", path, target] recreated, ["dev", path] a device node; and whether the system's
    directories are bound whole (the loader listed nothing)."""
    plan: list[list[str]] = [["link", top, os.readlink(top)] for top in SYSTEM_DIRS if os.path.islink(top)]
    libraries = _loaded_libraries(python)
    if not libraries:
        plan += [["dir", top] for top in SYSTEM_DIRS if os.path.isdir(top) and not os.path.islink(top)]
    for path in [python] + _import_path(python) + libraries:
        plan += _resolved(path)
    if os.path.isfile("/etc/ld.so.cache"):
        plan.append(["file", "/etc/ld.so.cache"])
    plan += [["dev", f"/dev/{d}"] for d in DEVICES if os.path.exists(f"/dev/{d}")]
    return _without_repeats(plan), not libraries


def files(plan: list[list[str]]) -> list[str]:
    """The regular files a plan lets a run read (its files, and those beneath its directories)."""
    out = [e[1] for e in plan if e[0] == "file"]
    for entry in plan:
        if entry[0] == "dir":
            for folder, _, names in os.walk(entry[1]):
                out += [os.path.join(folder, n) for n in names]
    return out


def warm(plan: list[list[str]], limit_bytes: int = WARM_LIMIT_BYTES) -> int:
    """Read ahead the plan's files, in its order (the interpreter and the libraries, then the
    standard library, then the site directories), up to `limit_bytes` (posix_fadvise WILLNEED:
    the kernel reads in this process's context, so the pages are charged to the worker's cgroup,
    not to a run's, and stay when a run's is emptied). Returns the bytes read ahead; ~20 ms for
    the system interpreter's 4,300 files (100 MB), cached."""
    total = 0
    for path in files(plan):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # a link, a socket, unreadable: no page a run could mark either
        try:
            size = os.fstat(fd).st_size
            if total + size > limit_bytes:
                continue
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            total += size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def _ask(argv: list[str], env: dict[str, str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=ASK_LIMIT_S, env=env, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def _import_path(python: str) -> list[str]:
    """sys.path of `python -I` (absolute entries that exist: directories, or a zip of the stdlib)."""
    try:
        paths = json.loads(_ask([python, "-I", "-c", IMPORT_PATH], ENV) or "[]")
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str) and os.path.isabs(p) and os.path.exists(p)]


def _extension_modules(python: str) -> list[str]:
    """The standard library's extension modules (lib-dynload)."""
    out = []
    for folder in _import_path(python):
        if os.path.basename(folder) == "lib-dynload" and os.path.isdir(folder):
            out += sorted(os.path.join(folder, n) for n in os.listdir(folder) if ".so" in n)
    return out


def _loaded_libraries(python: str) -> list[str]:
    """The paths (as the loader names them) of the shared libraries `python` and its standard
    library's extension modules load, its dynamic loader included; [] where the loader cannot
    list them."""
    preload = " ".join(_extension_modules(python) + list(ALWAYS_LOADED))
    text = _ask([python], dict(ENV, LD_TRACE_LOADED_OBJECTS="1", LD_PRELOAD=preload))
    found = []
    for line in text.splitlines():
        # "\tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)", "\t/lib64/ld-linux-x86-64.so.2 (0x...)"
        words = line.split()
        path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
        if os.path.isabs(path) and os.path.isfile(path):
            found.append(path)
    return found


def _resolved(path: str) -> list[list[str]]:
    """Entries that make `path` resolve in the root as on the host: a "link" for every symbolic
    link met on the way (each at a path whose directories are real), then the "dir" or "file"
    it ends at."""
    out, here, todo, hops = [], "/", [p for p in path.split("/") if p], 0
    while todo:
        part = todo.pop(0)
        if part in (".", ""):
            continue
        if part == "..":
            here = os.path.dirname(here)
            continue
        step = os.path.join(here, part)
        if os.path.islink(step):
            hops += 1
            if hops > 40:  # ELOOP: leave it out, as the loader would fail on it
                return []
            target = os.readlink(step)
            out.append(["link", step, target])
            here = "/" if target.startswith("/") else here
            todo = [p for p in target.split("/") if p] + todo
            continue
        here = step
    if os.path.isdir(here):
        out.append(["dir", here])
    elif os.path.isfile(here):
        out.append(["file", here])
    return out


def _without_repeats(plan: list[list[str]]) -> list[list[str]]:
    """Each path once, and nothing beneath a bound directory (already there, and a mount point
    made beneath one would be made in the host's directory)."""
    dirs = sorted({e[1] for e in plan if e[0] == "dir"})
    bound = [d for i, d in enumerate(dirs) if not any(d.startswith(o.rstrip("/") + "/") for o in dirs[:i])]

    def beneath(path: str) -> bool:
        return any(path.startswith(d.rstrip("/") + "/") for d in bound)
    out, seen = [], set()
    for entry in plan:
        key = entry[1]
        if key in seen or beneath(key) or (entry[0] == "dir" and key not in bound):
            continue
        seen.add(key)
        out.append(entry)
    return out
