"""The code sandbox's bounds (rollout/rewards/sandbox/run.py): time, processes, memory (across
processes, through memfd, shared memory), SysV IPC, the run's death with its worker; the cgroup
bounds where a cgroup can be made (these machines: v1, as root), and the fallback without one
forced. Isolation: test_sandbox.py."""
from __future__ import annotations

import ctypes
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout.rewards.sandbox import cgroup as sandbox_cgroup
from rollout.rewards.sandbox.run import FALLBACK_FILES, FALLBACK_PROCESSES, Sandbox
from sandboxes import leftovers, probed_sandbox
from rollout.rewards.settings import CodeSandboxSettings


ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["ns", "proc"])
def test_limits_hold_in_both_modes(mode, request):
    sandbox = request.getfixturevalue(mode)
    r = sandbox.run("print(int(input()) * 2)", b"21\n", 2.0)
    assert (r.status, r.stdout) == ("ok", b"42\n")
    t0 = time.monotonic()
    assert sandbox.run("while True: pass", b"", 1.0).status == "timeout"
    assert time.monotonic() - t0 < 1.0 + 1.5
    r = sandbox.run("import time; time.sleep(60)", b"", 1.0)  # wall time, not CPU
    assert r.status == "timeout"
    r = sandbox.run("s = 'x' * 10**5\nfor _ in range(10**4): print(s)", b"", 5.0)  # a 1 GB print
    assert r.status == "output_limit" and len(r.stdout) == 1 << 20
    r = sandbox.run("a = bytearray(10 * 2**30)", b"", 5.0)  # 10 GB
    assert r.status == "runtime_error" and b"MemoryError" in r.stderr_tail
    r = sandbox.run("import sys; sys.exit(3)", b"", 2.0)
    assert (r.status, r.returncode) == ("runtime_error", 3)
    assert leftovers(sandbox) == []


def test_a_run_ends_by_the_callers_deadline(ns):
    # the code reward's budget for a whole row: the run stops there, its own limit notwithstanding
    t0 = time.monotonic()
    r = ns.run("while True: pass", b"", 30.0, deadline=time.monotonic() + 0.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 1.5


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(ns):
    bomb = textwrap.dedent("""
        import os, time
        n = 0
        while True:
            try:
                os.fork()
                n += 1
            except OSError:
                time.sleep(0.01)
    """)
    t0 = time.monotonic()
    assert ns.run(bomb, b"", 2.0).status == "timeout"
    assert time.monotonic() - t0 < 2.0 + 2
    time.sleep(0.2)
    assert leftovers(ns) == []


@pytest.mark.parametrize("mode", ["ns", "proc"])
def test_a_double_forked_setsid_child_dies_with_the_run(mode, request):
    # the PID namespace's end (process mode: the run's cgroup, emptied) kills what setsid + double
    # fork would escape from a process group
    sandbox = request.getfixturevalue(mode)
    if mode == "proc" and sandbox.cgroups is None:
        pytest.skip("process mode without a cgroup: a setsid child escapes the group's kill (docs/rewards.md)")
    escape = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.closerange(0, 3)  # a daemon: nothing holds the run's pipes open
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert sandbox.run(escape, b"", 2.0).status == "ok"
    time.sleep(0.2)
    assert leftovers(sandbox) == []


SYSV = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
key = int(sys.stdin.read())
shm = libc.shmget(key, 1 << 20, 0o1666)             # IPC_CREAT | 0666
if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    ctypes.memset(addr, 1, 1 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
print(shm, libc.msgget(key, 0o1666))
"""
SYSV_FIND = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
key = int(sys.stdin.read())
print(libc.shmget(key, 0, 0), libc.msgget(key, 0))
"""


def _host_sysv(key: int) -> dict[str, int]:
    """The host's SysV objects with this key: kind -> id."""
    found = {}
    for kind in ("shm", "msg"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            k, ident = line.split()[:2]
            if int(k) == key:
                found[kind] = int(ident)
    return found


@pytest.mark.parametrize("mode", ["ns", "proc"])
def test_sysv_ipc_leaves_nothing_and_joins_no_runs(mode, request):
    # SysV shared memory and message queues outlive the run in the host's IPC namespace (memory
    # left behind, and a channel between runs)
    sandbox = request.getfixturevalue(mode)
    key = random.randrange(1 << 20, 1 << 30)
    try:
        made = sandbox.run(SYSV, str(key).encode(), 3.0)
        assert made.status == "ok", made.stderr_tail
        assert _host_sysv(key) == {}
        found = sandbox.run(SYSV_FIND, str(key).encode(), 3.0)
        assert found.stdout.split() == [b"-1", b"-1"], (made.stdout, found.stdout)
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        left = _host_sysv(key)
        if "shm" in left:
            libc.shmctl(left["shm"], 0, None)  # IPC_RMID: what the old sandbox left
        if "msg" in left:
            libc.msgctl(left["msg"], 0, None)


HOLD_IN_CHILDREN = """
import os, select, time
kids = {}
for _ in range(4):
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            b = bytearray(150 << 20)
            for i in range(0, len(b), 4096):
                b[i] = 1
            os.write(w, b"1")
        except MemoryError:
            pass
        time.sleep(30)
        os._exit(0)
    os.close(w)
    kids[r] = pid
t0 = time.monotonic()
holding = set()
while len(holding) < len(kids) and time.monotonic() - t0 < 1.5:
    holding |= set(select.select(list(kids), [], [], 0.1)[0])
time.sleep(0.3)
alive = [r for r in holding if os.waitpid(kids[r], os.WNOHANG) == (0, 0)]  # not killed for memory since
print(len(alive) * 150)
"""
HOLD_IN_MEMFDS = """
import os
held = 0
try:
    for _ in range(48):
        fd = os.memfd_create("x")
        for _ in range(16):
            os.write(fd, b"1" * (1 << 20))
            held += 1
except OSError as e:
    pass
print(held)
"""


def _held_mb(r) -> int:
    """What the program says it held at once; a run killed for memory held less than its limit."""
    return int(r.stdout) if r.status == "ok" else 0


def test_memory_is_bounded_for_the_whole_run_across_processes(small):
    # RLIMIT_AS is per process: four processes of 150 MB each under memory_mb 256
    r = small.run(HOLD_IN_CHILDREN, b"", 5.0)
    assert _held_mb(r) <= 256, (r.status, r.stdout)
    assert leftovers(small) == []


def test_memory_through_memfd_is_bounded(small):
    # memfd_create is outside RLIMIT_AS and the tmpfs sizes: 48 x 16 MB under memory_mb 256
    r = small.run(HOLD_IN_MEMFDS, b"", 5.0)
    assert _held_mb(r) <= 256, (r.status, r.stdout, r.stderr_tail[-300:])


def test_without_a_cgroup_memory_is_bounded_by_the_filter_and_fewer_processes(monkeypatch):
    monkeypatch.setattr(sandbox_cgroup.CgroupLayout, "find", classmethod(lambda cls: None))
    sandbox = probed_sandbox("namespaces", memory_mb=256)
    assert sandbox.cgroups is None and "no cgroup here" in sandbox.note
    r = sandbox.run(HOLD_IN_MEMFDS, b"", 5.0)
    assert r.status == "ok" and int(r.stdout) == 0  # memfd_create refused
    r = sandbox.run(SYSV, str(random.randrange(1 << 20, 1 << 30)).encode(), 2.0)
    assert r.stdout.split() == [b"-1", b"-1"]  # shmget and msgget refused
    r = sandbox.run(HOLD_IN_CHILDREN, b"", 5.0)
    # at most FALLBACK_PROCESSES processes of memory_mb each: the program and 3 children
    assert r.status == "ok" and int(r.stdout) <= (FALLBACK_PROCESSES - 1) * 150


SOCKET_BUFFERS = """
import resource, socket
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
queued, kept = 0, []
for _ in range(60):
    try:
        a, b = socket.socketpair()
    except OSError as e:
        print("refused", e.errno)
        break
    kept += [a, b]
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
    a.setblocking(False)
    try:
        while True:
            queued += a.send(bytes(1 << 16))
    except BlockingIOError:
        pass
for family in (socket.AF_UNIX, socket.AF_NETLINK):
    try:
        socket.socket(family, socket.SOCK_DGRAM).close()
        print("made", family)
    except OSError as e:
        print("refused", e.errno)
print(queued >> 20)
"""


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_without_a_cgroup_socket_buffers_are_refused_and_descriptors_fewer(isolation, monkeypatch):
    # unix socket buffers are kernel memory outside RLIMIT_AS: with no cgroup and memory_mb 256 one run
    # queued 3.77 GB in socketpairs
    monkeypatch.setattr(sandbox_cgroup.CgroupLayout, "find", classmethod(lambda cls: None))
    sandbox = probed_sandbox(isolation, memory_mb=256)
    assert sandbox.cgroups is None
    r = sandbox.run(SOCKET_BUFFERS, b"", 5.0)
    assert r.status == "ok", r.stderr_tail
    files, *refused, queued_mb = r.stdout.decode().splitlines()
    # netlink: no family of a run's (EAFNOSUPPORT), cgroup or not
    assert int(files) == FALLBACK_FILES and refused == ["refused 1"] * 2 + ["refused 97"] and queued_mb == "0"


def test_the_run_dies_with_its_reward_worker(ns):
    # a worker killed at its reward timeout takes its sandbox along (parent-death signals)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rollout.rewards.sandbox.run import Sandbox
        from rollout.rewards.settings import CodeSandboxSettings
        s = Sandbox(CodeSandboxSettings(isolation="namespaces"))
        s.probe()
        print(s.tag, flush=True)
        s.run("import time; time.sleep(120)", b"", 100.0)
    """)
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = worker.stdout.readline().strip()
    probe = Sandbox(CodeSandboxSettings())
    probe.tag = tag
    deadline = time.monotonic() + 20
    while not leftovers(probe) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(probe), "the sandboxed program never started"
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 5
    while leftovers(probe) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(probe) == []
