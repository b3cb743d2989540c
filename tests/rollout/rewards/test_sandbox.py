"""The code sandbox's isolation (rollout/rewards/sandbox/run.py): a test per promise docs/rewards.md
makes, each one failing if the promise is broken. The adversary is the policy being trained: each
attack class a tester found is a test here or in test_sandbox_bounds.py (what a run may use). The
namespace promises run where the machine allows user namespaces (these machines do, as root and as
nobody); process mode's own promises run everywhere. Nothing here depends on where the checkout is."""
from __future__ import annotations

import os
import socket
import textwrap
import uuid
from pathlib import Path

import pytest

from rollout.rewards.sandbox.run import Sandbox, SandboxUnavailable
from rollout.rewards.sandbox.users import run_user
from rollout.rewards.settings import CodeSandboxSettings


ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


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


def test_proc_holds_the_runs_processes_only(ns):
    # the kernel's own files of /proc (meminfo, sys, kallsyms, stat...) tell about the host; with
    # subset=pid (Linux 5.8+) only the PID namespace's processes are there
    if tuple(map(int, os.uname().release.split(".")[:2])) < (5, 8):
        pytest.skip("no subset=pid before Linux 5.8")
    r = ns.run("import os\nprint(*sorted(os.listdir('/proc')))", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    assert set(r.stdout.split()) == {b"1", b"self", b"thread-self"}


def test_runs_as_an_unprivileged_user_outside(ns):
    # the program's "root" is the namespace's: outside it is a user of the worker's own (as root:
    # no per-user budget shared with another worker's runs) or the worker's user
    r = ns.run("print(open('/proc/self/uid_map').read().split()[:3])", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    inside, outside, count = eval(r.stdout.decode())  # noqa: S307 - our own print of a list
    assert (inside, count) == ("0", "1") and int(outside) == (run_user() if os.geteuid() == 0 else os.geteuid())
    assert int(outside) != 65534 or os.geteuid() == 65534


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
        sysctl = '/proc/sys/user/max_user_namespaces'
        print(open(sysctl).read().strip() if os.path.exists('/proc/sys') else 'no /proc/sys')
    """), b"", 3.0)
    assert r.status == "ok", r.stderr_tail
    mount, cap_eff, unshare, child, max_ns = r.stdout.decode().splitlines()
    assert mount == "-1 Operation not permitted" and int(cap_eff, 16) == 0
    # the sysctl is written before /proc is mounted with subset=pid (5.8+: no /proc/sys inside), and
    # a failed write is a set-up failure, never a run
    assert unshare.startswith("-1 ") and child == "1" and max_ns in ("0", "no /proc/sys")


def test_ipc_uts_and_cgroup_namespaces_are_its_own(ns):
    r = ns.run("import os\nprint(*[os.readlink(f'/proc/self/ns/{n}') for n in ('ipc', 'uts', 'cgroup')])\n"
               "import socket\nprint(socket.gethostname())", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    inside, hostname = r.stdout.decode().splitlines()
    host = [os.readlink(f"/proc/self/ns/{n}") for n in ("ipc", "uts", "cgroup")]
    assert all(a != b for a, b in zip(inside.split(), host)) and hostname == "sandbox"


def test_process_mode_says_what_it_does_not_isolate(proc):
    assert "process isolation only" in proc.note and "the host's processes visible" in proc.note
    assert ("confined by Landlock" if proc.landlock else "NO file-system isolation") in proc.note
    r = proc.run("import os\nprint(os.getcwd(), oct(os.stat('.').st_mode & 0o777))", b"", 2.0)
    folder, mode = r.stdout.decode().split()
    assert folder.startswith("/tmp/gspo-sandbox-") and mode == "0o700"
    assert not Path(folder).exists()  # its folder is removed after the run


def _no_gvisor(monkeypatch) -> None:
    """gVisor out of reach, as on a machine without root or apt-get (where ensure_runsc says so)."""
    from rollout.rewards.sandbox import run as sandbox_run
    from rollout.rewards.sandbox.gvisor.setup import GvisorUnavailable

    def unavailable(log):
        raise GvisorUnavailable("no runsc here (Debian's `runsc` package: apt-get install runsc, as root)")
    monkeypatch.setattr(sandbox_run, "ensure_runsc", unavailable)


def test_auto_without_gvisor_is_the_namespaces_mode_and_says_what_that_leaves_open(monkeypatch):
    _no_gvisor(monkeypatch)
    sandbox = Sandbox(CodeSandboxSettings(isolation="auto"))
    note = sandbox.probe()
    assert sandbox.mode == "namespaces" and "\n" not in note
    assert "gVisor does not run here (no runsc here" in note and "the kernel is the host's" in note
    with pytest.raises(SandboxUnavailable, match=r"^rollout.reward_args.isolation='gvisor': no runsc here"):
        Sandbox(CodeSandboxSettings(isolation="gvisor")).probe()


def test_auto_never_falls_back_to_process_mode(monkeypatch):
    # where namespaces cannot be made (and gVisor does not run), auto refuses in one line naming
    # the weaker choice
    _no_gvisor(monkeypatch)
    monkeypatch.setattr(Sandbox, "_prefix", lambda self, mode: ["false"] if mode == "namespaces" else [])
    sandbox = Sandbox(CodeSandboxSettings(isolation="auto"))
    with pytest.raises(SandboxUnavailable) as e:
        sandbox.probe()
    assert "rollout.reward_args.isolation: process" in str(e.value) and "weaker" in str(e.value)
    assert "\n" not in str(e.value) and sandbox.mode is None


def test_namespaces_required_where_the_machine_forbids_them_is_one_error():
    sandbox = Sandbox(CodeSandboxSettings(isolation="namespaces", python="/nonexistent/python"))
    with pytest.raises(SandboxUnavailable, match="isolation='namespaces': the sandbox's namespaces cannot be made"):
        sandbox.probe()
