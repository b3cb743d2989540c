"""What a sandboxed run may read (rollout/rewards/sandbox/interpreter_files.py): the interpreter's
files only, each name resolving as on the host, enough for an honest program's imports; and no
channel between runs through the host's page cache (a program with no task logic scored 1.0
right after a sibling that solved the row and marked pages of /usr with its answers)."""
from __future__ import annotations

import ctypes
import json
import os
import random

import pytest

from rollout.rewards.sandbox.interpreter_files import files, root_plan

pytestmark = pytest.mark.slow


def test_the_plan_holds_the_interpreter_its_import_path_and_their_libraries(ns):
    plan, whole = root_plan(ns.python)
    assert plan == ns.root and not whole, "the loader listed no library (a C library other than glibc?)"
    dirs = {e[1] for e in plan if e[0] == "dir"}
    assert "/usr" not in dirs and not {"/", "/opt", "/home", "/root", "/usr/lib", "/usr/share"} & dirs
    real = {os.path.realpath(e[1]) for e in plan if e[0] == "file"}
    assert os.path.realpath(ns.python) in real and any(os.path.basename(p).startswith("libc.so") for p in real)
    # every entry is at a path whose directories are real, so build_root makes it in its tmpfs
    for entry in plan:
        assert os.path.realpath(os.path.dirname(entry[1])) == os.path.dirname(entry[1]), entry
    r = ns.run("import json, sys\nprint(json.dumps(sys.path))", b"", 5.0)
    assert r.status == "ok", r.stderr_tail
    assert [p for p in json.loads(r.stdout) if os.path.exists(p)] == [p for p in json.loads(r.stdout)
                                                                       if any(p == d or p.startswith(d + "/")
                                                                              for d in dirs)]


HONEST = """
import array, asyncio, bisect, bz2, collections, ctypes, dataclasses, datetime, decimal, fractions, functools
import hashlib, heapq, itertools, json, lzma, math, random, re, sqlite3, statistics, string, struct, sys
import threading, zlib
t = threading.Thread(target=lambda: None); t.start(); t.join()
asyncio.run(asyncio.sleep(0))
db = sqlite3.connect(":memory:"); db.execute("create table t (x)")
print(hashlib.sha256(b"x").hexdigest()[:8], decimal.Decimal(1) / 3, fractions.Fraction(1, 3),
      len(zlib.compress(lzma.compress(bz2.compress(b"x")))) > 0, ctypes.sizeof(ctypes.c_int))
"""


@pytest.mark.parametrize("mode", ["ns", "proc"])
def test_an_honest_programs_standard_library_is_there(mode, request):
    # the root holds the interpreter's files only: what a solution imports (C extensions with their
    # libraries: sqlite3, hashlib, lzma, ctypes) still loads
    r = request.getfixturevalue(mode).run(HONEST, b"", 10.0)
    assert r.status == "ok", r.stderr_tail
    assert r.stdout.split()[0] == b"2d711642" and r.stdout.split()[-1] == b"4"


def _cold_files(plan: list[list[str]], n: int) -> list[str]:
    """n source files of the sandbox's standard library, large enough for a first page of their own
    (the interpreter reads their .pyc; no test here reads them), in a fixed order."""
    found = sorted(p for p in files(plan) if p.endswith(".py") and os.path.getsize(p) > 16384)
    if len(found) < n:
        pytest.skip(f"fewer than {n} large sources in this interpreter's standard library")
    return found[::len(found) // n][:n]


def _evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached(paths: list[str]) -> list[int]:
    """1 where the first page of the file is in the host's page cache: mincore, as the files' owner
    (else the kernel answers 1 for every page). Not preadv2's RWF_NOWAIT, whose miss starts a
    read-ahead: the page is cached right after."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    out = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        address = libc.mmap(None, ctypes.c_size_t(4096), 1, 1, fd, ctypes.c_long(0))  # PROT_READ, MAP_SHARED
        os.close(fd)
        vector = ctypes.create_string_buffer(1)
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(4096), vector) == 0
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(4096))
        out.append(vector.raw[0] & 1)
    return out


PUBLISH = """
import json, sys
paths, bits = json.loads(sys.stdin.read())
for path, bit in zip(paths, bits):
    if bit:
        with open(path, "rb") as f:
            f.read(1)
print("published")
"""
READ = """
import ctypes, json, os, resource, sys
paths = json.loads(sys.stdin.read())
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
def nowait(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return 1
    except BlockingIOError:
        return 0
    except OSError:
        return "refused"
    finally:
        os.close(fd)
def mapped(path):
    fd = os.open(path, os.O_RDONLY)
    address = libc.mmap(None, ctypes.c_size_t(4096), 1, 1, fd, ctypes.c_long(0))  # PROT_READ, MAP_SHARED
    os.close(fd)
    return address
def resident(path):
    address, vector = mapped(path), ctypes.create_string_buffer(1)
    rc = libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(4096), vector)
    libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(4096))
    return "refused" if rc != 0 else vector.raw[0] & 1
def no_major_fault(path):
    address = mapped(path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    ctypes.string_at(address, 1)
    faulted = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
    libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(4096))
    return 0 if faulted else 1
print(json.dumps({"RWF_NOWAIT": [nowait(p) for p in paths], "mincore": [resident(p) for p in paths],
                  "major faults": [no_major_fault(p) for p in paths]}))
"""


@pytest.mark.parametrize("mode", ["ns", "proc"])
def test_no_channel_between_runs_through_the_page_cache(mode, request):
    # a publisher reads the first page of the files whose bit is 1; a later run tells which pages
    # are cached: RWF_NOWAIT and mincore without reading, a major fault on reading
    sandbox = request.getfixturevalue(mode)
    if sandbox.cgroups is None:
        pytest.skip("without a cgroup the pages a run reads stay cached (docs/rewards.md)")
    if os.geteuid() != 0:
        pytest.skip("telling what is cached (mincore) needs the files' owner: root")
    paths = _cold_files(sandbox.root, 16)
    bits = [1] * 8 + [0] * 8
    random.Random(7).shuffle(bits)
    _evict(paths)
    if _cached(paths) != [0] * len(paths):
        pytest.skip("the host keeps these files cached (mapped by someone)")
    published = sandbox.run(PUBLISH, json.dumps([paths, bits]).encode(), 5.0)
    assert published.status == "ok", published.stderr_tail
    assert _cached(paths) == [0] * len(paths), bits  # the pages it read left with its cgroup
    read = sandbox.run(READ, json.dumps(paths).encode(), 5.0)
    assert read.status == "ok", read.stderr_tail
    for method, seen in json.loads(read.stdout).items():  # refused, or the same for every page
        assert seen == ["refused"] * len(seen) or len(set(seen)) == 1, (method, seen, bits)
