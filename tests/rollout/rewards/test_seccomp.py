"""The code sandbox's system-call filter (rollout/rewards/seccomp.py): a well-formed BPF program on
each machine it knows, and, installed here in a child, what it refuses and what it lets through."""
from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.rewards.seccomp import AUDIT_ARCH, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K, build_filter, machine

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
        from rollout.rewards.seccomp import build_filter
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
