"""The code sandbox (rollout/rewards/sandbox.py): a test per promise docs/rewards.md makes, each
one failing if the promise is broken. The adversary is the policy being trained: each attack class
a tester found is a test here. The namespace promises run where the machine allows user namespaces
(these machines do, as root and as nobody); the cgroup ones where a cgroup can be made (these
machines: v1, as root), and the fallback without one is forced; process mode's own promises run
everywhere. Nothing here depends on where the checkout is."""
from __future__ import annotations

import ctypes
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rollout.rewards import sandbox_cgroup
from rollout.rewards.sandbox import FALLBACK_PROCESSES, SANDBOX_ENV, Sandbox, SandboxUnavailable
from rollout.rewards.settings import CodeSandboxSettings

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _sandbox(isolation: str, **kw) -> Sandbox:
    sandbox = Sandbox(CodeSandboxSettings(isolation=isolation, **kw))
    try:
        sandbox.probe()
    except SandboxUnavailable as e:
        pytest.skip(f"no {isolation} sandbox on this machine: {e}")
    return sandbox


@pytest.fixture(scope="module")
def ns() -> Sandbox:
    return _sandbox("namespaces", max_output_bytes=1 << 20)


@pytest.fixture(scope="module")
def proc() -> Sandbox:
    return _sandbox("process", max_output_bytes=1 << 20)


@pytest.fixture(scope="module")
def small() -> Sandbox:
    """256 MiB per test, in a cgroup (skipped where none can be made)."""
    sandbox = _sandbox("namespaces", memory_mb=256)
    if sandbox.cgroups is None:
        pytest.skip("no cgroup can be made here (the fallback has its own test)")
    return sandbox


def leftovers(sandbox: Sandbox) -> list[int]:
    """Processes still running with this sandbox's tag in their environment."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(SANDBOX_ENV) == sandbox.tag:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


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


def test_no_network(ns):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    r = ns.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", b"", 3.0)
    assert r.status == "runtime_error" and b"Network is unreachable" in r.stderr_tail
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing reached the host's port
    listener.close()


@pytest.fixture
def host_markers(tmp_path):
    """World-readable files where a policy would look for the expected outputs: the test's own
    folder and the checkout (its data, its run folders), and a unix socket anyone may connect to."""
    token = uuid.uuid4().hex
    files = [tmp_path / f"marker-{token}", ROOT / f".sandbox-marker-{token}"]
    for f in files:
        f.write_text(token)
        f.chmod(0o644)
    tmp_path.chmod(0o755)
    sock_path = ROOT / f".sandbox-sock-{token[:8]}"
    if len(str(sock_path)) > 100:  # past what a unix socket's path may hold
        sock_path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    sock_path.chmod(0o777)
    server.listen(1)
    yield token, files, sock_path
    server.close()
    for f in files + [sock_path]:
        f.unlink(missing_ok=True)


def test_the_hosts_files_are_out_of_reach(ns, host_markers):
    # a program with no task logic that finds the row's tests on the host scores 1.0: nothing of
    # the host may be there (reward hacking through the host's files)
    token, files, sock_path = host_markers
    r = ns.run(textwrap.dedent(f"""
        import os, socket
        for path in {[str(f) for f in files]!r}:
            try:
                print("READ", open(path).read())
            except OSError as e:
                print("unreadable", e.errno)
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({str(sock_path)!r})
            print("CONNECTED")
        except OSError as e:
            print("unreachable", e.errno)
        print(*[p for p in {[str(ROOT), "/sys", "/home", "/root", "/var", "/run", "/mnt", "/opt", "/srv"]!r}
                if os.path.exists(p)])
    """), b"", 3.0)
    assert r.status == "ok", r.stderr_tail
    assert token not in r.stdout.decode() and b"CONNECTED" not in r.stdout
    *reads, sock, present = r.stdout.decode().split("\n")[:-1]
    assert reads == ["unreadable 2", "unreadable 2"] and sock == "unreachable 2"  # ENOENT: not there
    interpreter = {"/" + p[1].split("/")[1] for p in ns.root if p[0] == "dir"}  # e.g. /opt of a conda prefix
    assert set(present.split()) <= interpreter - {"/usr"}, present


def test_the_root_holds_the_interpreter_only_and_is_read_only(ns):
    marker = f"gspo-sandbox-{uuid.uuid4().hex}"
    r = ns.run(textwrap.dedent(f"""
        import os
        print(*sorted(os.listdir('/')))
        print(*sorted(os.listdir('/dev')))
        for path in ('/x', '/usr/x', '/etc/x', '/dev/x', '/dev/null2'):
            try:
                open(path, 'w')
                print(path, 'WRITTEN')
            except OSError as e:
                print(path, e.strerror)
        open('/dev/null', 'w').write('x')
        print(len(open('/dev/urandom', 'rb').read(16)))
        open('/tmp/{marker}', 'w').write('x')
        open('here', 'w').write('y')
        open('/dev/shm/z', 'w').write('z')
        print(os.getcwd())
    """), b"", 3.0)
    assert r.status == "ok", r.stderr_tail
    top, dev, *writes, urandom, cwd = r.stdout.decode().splitlines()
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    extra = {p[1].split("/")[1] for p in ns.root if p[0] == "dir"}  # an interpreter's prefix elsewhere
    assert set(top.split()) <= allowed | extra and {"proc", "tmp", "usr", "dev"} <= set(top.split())
    assert dev.split() == sorted(["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout",
                                  "urandom", "zero"])
    assert all(w.endswith("Read-only file system") for w in writes), writes
    assert urandom == "16" and cwd == "/tmp"
    assert not Path(f"/tmp/{marker}").exists() and not Path("here").exists()  # its own, gone with it


def test_no_other_process_visible(ns):
    r = ns.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    assert r.stdout.decode().strip() == "[1]"


def test_runs_as_an_unprivileged_user_outside(ns):
    # the program's "root" is the namespace's: outside it is nobody (as root) or the worker's user
    r = ns.run("print(open('/proc/self/uid_map').read().split()[:3])", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    inside, outside, count = eval(r.stdout.decode())  # noqa: S307 - our own print of a list
    assert (inside, count) == ("0", "1") and int(outside) == (65534 if os.geteuid() == 0 else os.geteuid())


def test_capabilities_are_dropped_and_nested_user_namespaces_refused(ns):
    # a child user namespace would give the program every capability in it again
    r = ns.run(textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)
        print(rc, os.strerror(ctypes.get_errno()))
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
        print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))   # CLONE_NEWUSER
        pid = os.fork()
        if pid == 0:
            os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
        print(os.waitpid(pid, 0)[1] >> 8)
        print(open('/proc/sys/user/max_user_namespaces').read().strip())
    """), b"", 3.0)
    assert r.status == "ok", r.stderr_tail
    mount, cap_eff, unshare, child, max_ns = r.stdout.decode().splitlines()
    assert mount == "-1 Operation not permitted" and int(cap_eff, 16) == 0
    assert unshare.startswith("-1 ") and child == "1" and max_ns == "0"


def test_ipc_uts_and_cgroup_namespaces_are_its_own(ns):
    r = ns.run("import os\nprint(*[os.readlink(f'/proc/self/ns/{n}') for n in ('ipc', 'uts', 'cgroup')])\n"
               "import socket\nprint(socket.gethostname())", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    inside, hostname = r.stdout.decode().splitlines()
    host = [os.readlink(f"/proc/self/ns/{n}") for n in ("ipc", "uts", "cgroup")]
    assert all(a != b for a, b in zip(inside.split(), host)) and hostname == "sandbox"


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
    sandbox = _sandbox("namespaces", memory_mb=256)
    assert sandbox.cgroups is None and "no cgroup here" in sandbox.note
    r = sandbox.run(HOLD_IN_MEMFDS, b"", 5.0)
    assert r.status == "ok" and int(r.stdout) == 0  # memfd_create refused
    r = sandbox.run(SYSV, str(random.randrange(1 << 20, 1 << 30)).encode(), 2.0)
    assert r.stdout.split() == [b"-1", b"-1"]  # shmget and msgget refused
    r = sandbox.run(HOLD_IN_CHILDREN, b"", 5.0)
    # at most FALLBACK_PROCESSES processes of memory_mb each: the program and 3 children
    assert r.status == "ok" and int(r.stdout) <= (FALLBACK_PROCESSES - 1) * 150


def test_the_run_dies_with_its_reward_worker(ns):
    # a worker killed at its reward timeout takes its sandbox along (parent-death signals)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rollout.rewards.sandbox import Sandbox
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


def test_process_mode_says_what_it_does_not_isolate(proc):
    assert "NO network or file-system isolation" in proc.note
    r = proc.run("import os\nprint(os.getcwd())", b"", 2.0)
    assert r.stdout.decode().startswith("/tmp/gspo-sandbox-")
    assert not Path(r.stdout.decode().strip()).exists()  # its folder is removed after the run


def test_auto_never_falls_back_to_process_mode(monkeypatch):
    # where namespaces cannot be made, auto refuses in one line naming the weaker choice
    monkeypatch.setattr(Sandbox, "_prefix", lambda self, mode: ["false"] if mode == "namespaces" else [])
    sandbox = Sandbox(CodeSandboxSettings(isolation="auto"))
    with pytest.raises(SandboxUnavailable) as e:
        sandbox.probe()
    assert "rollout.code_sandbox.isolation: process" in str(e.value) and "weaker" in str(e.value)
    assert "\n" not in str(e.value) and sandbox.mode is None


def test_namespaces_required_where_the_machine_forbids_them_is_one_error():
    sandbox = Sandbox(CodeSandboxSettings(isolation="namespaces", python="/nonexistent/python"))
    with pytest.raises(SandboxUnavailable, match="isolation='namespaces': the sandbox's namespaces cannot be made"):
        sandbox.probe()
