"""The code sandbox (rollout/rewards/sandbox.py): a test per promise docs/rewards.md makes, each
one failing if the promise is broken. The namespace promises run where the machine allows user
namespaces (these machines do, as root and as nobody); process mode's own promises run everywhere."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rollout.rewards.sandbox import SANDBOX_ENV, Sandbox, SandboxUnavailable
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


@pytest.fixture
def outside_dir():
    """A folder on the host's disk, outside /tmp, that anyone may write to."""
    path = ROOT / "runs" / f"sandbox-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    path.chmod(0o777)
    yield path
    for f in path.iterdir():
        f.unlink()
    path.rmdir()


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


def test_a_double_forked_setsid_child_dies_with_the_run(ns, proc):
    # the PID namespace's end kills what setsid + double fork would escape from a process group
    escape = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert ns.run(escape, b"", 2.0).status == "ok"
    time.sleep(0.2)
    assert leftovers(ns) == []


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


def test_the_file_system_is_read_only_and_tmp_is_private(ns, outside_dir):
    target = outside_dir / "written"
    r = ns.run(f"open({str(target)!r}, 'w').write('x')", b"", 2.0)
    assert r.status == "runtime_error" and b"Read-only file system" in r.stderr_tail
    assert not target.exists()
    marker = f"gspo-sandbox-{uuid.uuid4().hex}"
    r = ns.run(f"import os\nopen('/tmp/{marker}', 'w').write('x')\nopen('here', 'w').write('y')\n"
               f"print(os.getcwd(), sorted(os.listdir('/tmp')))", b"", 2.0)
    assert r.status == "ok" and r.stdout.decode().startswith("/tmp ")  # writable, its own
    assert not Path(f"/tmp/{marker}").exists() and not Path("here").exists()  # gone with it


def test_no_other_process_visible_and_homes_hidden(ns):
    r = ns.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
               "print(os.listdir('/root'), os.listdir('/home') if os.path.isdir('/home') else [])", b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    pids, homes = r.stdout.decode().splitlines()
    assert pids == "[1]" and homes == "[] []"


def test_files_only_root_may_read_stay_unread(ns, outside_dir):
    secret = outside_dir / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)  # the host's root may read it; the sandbox's "root" is nobody outside
    r = ns.run(f"print(open({str(secret)!r}).read())", b"", 2.0)
    assert r.status == "runtime_error" and b"Permission denied" in r.stderr_tail and b"s3cret" not in r.stdout


def test_capabilities_are_dropped(ns):
    r = ns.run(textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None)
        print(rc, os.strerror(ctypes.get_errno()))
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
    """), b"", 2.0)
    assert r.status == "ok", r.stderr_tail
    mount, cap_eff = r.stdout.decode().splitlines()
    assert mount == "-1 Operation not permitted" and int(cap_eff, 16) == 0


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


def test_namespaces_required_where_the_machine_forbids_them_is_one_error(monkeypatch):
    sandbox = Sandbox(CodeSandboxSettings(isolation="namespaces", python="/nonexistent/python"))
    with pytest.raises(SandboxUnavailable, match="isolation='namespaces': no sandbox runs here"):
        sandbox.probe()
