"""The code sandbox's system-call filter (rollout/rewards/sandbox/seccomp.py): a well-formed BPF program on
each machine it knows, and, installed here in a child, what it refuses and what it lets through."""
from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.rewards.sandbox.seccomp import AUDIT_ARCH, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K, build_filter, machine

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("arch", sorted(AUDIT_ARCH))
@pytest.mark.parametrize("memory_unbounded,shared_host", [(False, False), (True, False), (True, True)])
def test_every_jump_lands_inside_the_filter(arch, memory_unbounded, shared_host):
    program = build_filter(memory_unbounded=memory_unbounded, shared_host=shared_host, self_pid=1234, arch=arch)
    ops = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    assert len(program) % 8 == 0 and len(ops) < 4096 and ops[-1][0] == BPF_RET_K
    for i, (code, jt, jf, _) in enumerate(ops):
        if code in (BPF_JEQ_K, BPF_JSET_K, BPF_JGE_K):
            assert i + 1 + max(jt, jf) < len(ops), (i, jt, jf)


@pytest.mark.skipif(machine() is None, reason="no filter for this architecture")
def test_the_filter_refuses_what_it_names_and_nothing_a_program_needs():
    script = textwrap.dedent(f"""
        import ctypes, os, subprocess, sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from rollout.rewards.sandbox.seccomp import build_filter
        program = build_filter(memory_unbounded=True, shared_host=True, self_pid=os.getpid())
        libc = ctypes.CDLL(None, use_errno=True)
        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
        buf = ctypes.create_string_buffer(program, len(program))
        assert libc.prctl(38, 1, 0, 0, 0) == 0                                    # no_new_privs
        assert libc.prctl(22, 2, ctypes.byref(Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_char_p))), 0, 0) == 0
        def refused(call):
            try:
                return call() == -1 and ctypes.get_errno() == 1
            except PermissionError:
                return True
        print(refused(lambda: os.memfd_create("x")), refused(lambda: libc.unshare(0x10000000)),
              refused(lambda: libc.shmget(0, 4096, 0o1666)), refused(lambda: os.kill(os.getppid(), 0)))
        t = threading.Thread(target=lambda: None); t.start(); t.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        os.kill(os.getpid(), 0)
        print(os.waitpid(pid, 0)[1] >> 8, subprocess.run(["true"]).returncode)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "True", "7", "0"]


SOCKETS_AND_FADVISE = """
import ctypes, os, socket, sys
sys.path.insert(0, {root!r})
from rollout.rewards.sandbox.seccomp import build_filter
program = build_filter(memory_unbounded={memory_unbounded}, shared_host={shared_host}, self_pid=os.getpid())
libc = ctypes.CDLL(None, use_errno=True)
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
buf = ctypes.create_string_buffer(program, len(program))
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.byref(Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_char_p))), 0, 0) == 0
def attempt(make):
    try:
        make().close()
        return "made"
    except OSError as e:
        return e.errno
out = {{name: attempt(lambda family=family: socket.socket(family, socket.SOCK_DGRAM if family == 16 else
                                                         socket.SOCK_STREAM))
        for name, family in (("unix", 1), ("inet", 2), ("inet6", 10), ("netlink", 16), ("vsock", 40),
                             ("packet", 17))}}
out["pair"] = attempt(lambda: socket.socketpair()[0])
with open(sys.executable, "rb") as f:
    try:
        os.posix_fadvise(f.fileno(), 0, 0, 99)   # no such advice: EINVAL, if the call ran
        out["fadvise"] = "no-op"
    except OSError as e:
        out["fadvise"] = e.errno
print(out)
"""


@pytest.mark.skipif(machine() is None, reason="no filter for this architecture")
@pytest.mark.parametrize("memory_unbounded,shared_host", [(False, False), (True, False), (False, True), (True, True)])
def test_socket_families_and_fadvise(memory_unbounded, shared_host):
    # families the network namespace does not confine (AF_VSOCK reaches the hypervisor's host) are
    # refused; where no cgroup counts kernel memory, unix and netlink buffers are refused too (one run
    # queued 3.77 GB in unix sockets under memory_mb 256); process mode shares the host's network, so
    # no socket; posix_fadvise is a no-op (DONTNEED evicts the host's page cache for everyone)
    script = SOCKETS_AND_FADVISE.format(root=str(ROOT), memory_unbounded=memory_unbounded, shared_host=shared_host)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = eval(out.stdout)  # noqa: S307 - our own print of a dict
    EPERM, EAFNOSUPPORT = 1, 97
    allowed = {"inet", "inet6"} if memory_unbounded else {"unix", "inet", "inet6", "netlink"}
    if shared_host:
        allowed = set()
    assert {k for k in ("unix", "inet", "inet6", "netlink") if got[k] == "made"} == allowed, got
    assert {got[k] for k in ("unix", "inet", "inet6", "netlink") if k not in allowed} <= {EPERM}, got
    assert got["vsock"] == got["packet"] == EAFNOSUPPORT and got["fadvise"] == "no-op"
    assert got["pair"] == (EPERM if memory_unbounded else "made")
