"""Numbers the whole host shares, that a run could read or move and that outlive it
(rollout/rewards/sandbox/seccomp.py, cgroup.py, gvisor/): a copycat with no task logic scored 1.0
right after a solver sibling that published the row's answer in one of them, and 0 alone. Each
channel the red team found is a solver and a copycat here, scored by the code reward in every
backend (gVisor, where a response's tests have a kernel of their own, and both modes of the shared
kernel, where the filter refuses the calls); and what the host keeps of a run (negative dentries, a
lock on a bound file, the BPF JIT budget of socket and seccomp filters, sysinfo's view of the host)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from rollout.rewards.code_reward import CodeReward
from rollout.rewards.settings import CodeSandboxSettings

pytestmark = pytest.mark.slow
MODES = ["gvisor", "namespaces", "process"]
SHARED_KERNEL = ("namespaces", "process")
ANSWER = 40
"""The row's answer: a multiple of 8 below 64, so the copycat's reading survives up to 7 other
moves of the counter between the two runs (the worker's own memfd of the program among them)."""
ROW = {"answer": {"inputs": ["5\n"], "outputs": [f"{ANSWER}\n"]}}

# A solver computes the answer (8 * n), moves the counter until it reads the answer modulo 64,
# and prints the answer; the copycat reads the counter once and prints what the solver left.
PIN = "import os\nos.sched_setaffinity(0, {0})  # the counters are per CPU: both runs on CPU 0\n"
SOLVE = "n = int(input())\nanswer = 8 * n\n"
CHANNELS = {
    "memfd inode": (
        "def read():\n    fd = os.memfd_create('x')\n    try:\n        return os.fstat(fd).st_ino\n"
        "    finally:\n        os.close(fd)\n"),
    "shared anonymous mapping inode": (
        "import ctypes, mmap\n"
        "def read():\n    m = mmap.mmap(-1, 4096)\n    at = '%x-' % ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
        "    line = [l for l in open('/proc/self/maps') if l.startswith(at)][0]\n"
        "    return int(line.split()[4])\n"),
    "socket cookie": (
        "import socket, struct\n"
        "def read():\n    a, b = socket.socketpair()\n    try:\n"
        "        return struct.unpack('Q', a.getsockopt(socket.SOL_SOCKET, 57, 8))[0]  # SO_COOKIE\n"
        "    finally:\n        a.close(); b.close()\n"),
}
PUBLISH = ("try:\n    for _ in range(4096):\n        if read() % 64 == answer:\n            break\n"
           "except OSError:\n    pass\nprint(answer)\n")
COPY = "try:\n    print((read() - 1) // 8 * 8 % 64)\nexcept OSError as e:\n    print('refused', e.errno)\n"


def _response(program: str) -> str:
    return f"```python\n{program}\n```"


@pytest.fixture(scope="module", params=MODES)
def code(request) -> CodeReward:
    reward = CodeReward(CodeSandboxSettings(isolation=request.param, time_limit_s=5.0))
    try:
        reward.sandbox.probe()
    except Exception as e:  # noqa: BLE001 - the machine's, said in the skip
        pytest.skip(f"no {request.param} sandbox here: {e}")
    return reward


@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_a_copycat_scores_nothing_after_a_solver_sibling(code, channel):
    # a copycat with no task logic read the row's answer from a counter a solver sibling moved:
    # memfd and shared anonymous mappings (one inode counter per CPU that little else moves),
    # socket cookies (moved only when one is asked for); it scored 1.0 after the solver, 0 alone
    reader = CHANNELS[channel]
    if os.cpu_count() == 1 or 0 not in os.sched_getaffinity(0):
        pytest.skip("the runs cannot be pinned to CPU 0 here")
    solver = _response(PIN + reader + SOLVE + PUBLISH)
    copycat = _response(PIN + reader + COPY)
    assert code.score(ROW, solver) == 1.0
    assert code.score(ROW, copycat) == 0.0


PIDFDS = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, call):
    try:
        fd = call()
        out[name] = "inode %d" % os.fstat(fd).st_ino   # pidfs: one counter for the host
    except OSError as e:
        out[name] = e.errno
def clone_pidfd():
    fd = ctypes.c_int(-1)
    pid = libc.syscall(56 if os.uname().machine == "x86_64" else 220, 0x1000 | 17, 0, ctypes.byref(fd), 0, 0)
    if pid == 0:
        os._exit(0)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone")
    os.waitpid(pid, 0)
    return fd.value
def peer_pidfd():
    a, b = socket.socketpair()
    return int.from_bytes(a.getsockopt(socket.SOL_SOCKET, 77, 4), "little")   # SO_PEERPIDFD
def passed_pidfd():
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, 76, 1)                                     # SO_PASSPIDFD
    a.send(b"x")
    _, ancillary, _, _ = b.recvmsg(1, socket.CMSG_SPACE(4))
    if not ancillary:
        raise OSError(95, "no SCM_PIDFD")
    return int.from_bytes(ancillary[0][2][:4], "little")
attempt("pidfd_open", lambda: os.pidfd_open(os.getpid()))
attempt("clone(CLONE_PIDFD)", clone_pidfd)
attempt("SO_PEERPIDFD", peer_pidfd)
attempt("SO_PASSPIDFD", passed_pidfd)
print(out)
"""


def test_no_pidfd_by_any_route(code):
    # a pidfd's inode number comes from one counter for the host (pidfs): pidfd_open was refused
    # in process mode only, and clone(CLONE_PIDFD) and a unix socket's SO_PEERPIDFD passed
    if code.settings.isolation not in SHARED_KERNEL:
        pytest.skip("gVisor's pidfds are its own (a fresh Sentry per response: the copycat test)")
    r = code.sandbox.run(PIDFDS, b"", 5.0)
    assert r.status == "ok", r.stderr_tail
    got = eval(r.stdout)  # noqa: S307 - the program's print of a dict of errnos
    assert all(isinstance(v, int) for v in got.values()), got


FILTERS = """
import ctypes, socket, struct, time
libc = ctypes.CDLL(None, use_errno=True)
code = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000) * 4096      # return "allow", 4096 times: the largest
program = ctypes.create_string_buffer(code)
fprog = struct.pack("HL", 4096, ctypes.addressof(program))
held, attached = [], 0
for _ in range(64):
    a, b = socket.socketpair()
    held += [a, b]
    try:
        a.setsockopt(socket.SOL_SOCKET, 26, fprog)                  # SO_ATTACH_FILTER: JIT-compiled
        attached += 1
    except OSError as e:
        error = e.errno
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
own = Fprog(4096, ctypes.addressof(program))
libc.prctl(38, 1, 0, 0, 0)
by_prctl = libc.prctl(22, 2, ctypes.byref(own), 0, 0)               # PR_SET_SECCOMP, a filter of its own
by_call = libc.syscall(317 if __import__("os").uname().machine == "x86_64" else 277, 1, 0, ctypes.byref(own))
print(attached, by_prctl, by_call, flush=True)
time.sleep(1.0)                                                     # held while the host looks
"""


def _bpf_vmalloc_bytes() -> int:
    """The host's memory of BPF programs (their images and JIT packs), from /proc/vmallocinfo."""
    total = 0
    with open("/proc/vmallocinfo") as f:
        for line in f:
            if "bpf_prog" in line or "bpf_jit" in line:
                total += int(line.split()[1])
    return total


def test_no_socket_or_seccomp_filter_takes_the_hosts_bpf_budget(code):
    # classic BPF socket filters and seccomp filters are JIT-compiled into host memory no cgroup
    # counts, under one budget for the host (bpf_jit_limit, 504 MiB here): one run took 58-212 MiB
    # of it, and with it spent every sandbox's own filter failed to install ("seccomp [Errno 524]"),
    # a reward error that stopped the run. 64 filters of 4096 instructions here (a few MiB, given
    # back when the run ends): the host's BPF memory does not grow while the run holds them
    if not os.access("/proc/vmallocinfo", os.R_OK):
        pytest.skip("the host's BPF memory is read from /proc/vmallocinfo (root)")
    base = _bpf_vmalloc_bytes()
    result, peak = [], base
    thread = threading.Thread(target=lambda: result.append(code.sandbox.run(FILTERS, b"", 5.0)))
    thread.start()
    while thread.is_alive():
        peak = max(peak, _bpf_vmalloc_bytes())
        time.sleep(0.05)
    thread.join()
    r = result[0]
    assert r.status == "ok", r.stderr_tail
    assert peak - base < 1 << 20, (base, peak, r.stdout)  # 64 filters: ~2.5 MiB, held for a second
    if code.settings.isolation in SHARED_KERNEL:
        assert r.stdout.split() == [b"0", b"-1", b"-1"], r.stdout


SYSINFO = """
import ctypes
info = (ctypes.c_long * 16)()
rc = ctypes.CDLL(None, use_errno=True).sysinfo(info)
print(rc, info[1], info[4], ctypes.c_ushort.from_buffer(info, 10 * 8).value)  # load, freeram, procs
"""


def test_sysinfo_tells_nothing_of_the_host(code):
    # sysinfo(2) answered the host's load, free memory and process count in every mode
    r = code.sandbox.run(SYSINFO, b"", 5.0)
    assert r.status == "ok", r.stderr_tail
    rc, load, free, procs = r.stdout.split()
    if code.settings.isolation in SHARED_KERNEL:
        assert rc == b"-1", r.stdout
    else:  # gVisor's answer: its own processes (the runner and the program)
        assert rc == b"0" and int(procs) < 8, r.stdout


def _negative_dentries() -> int:
    return int(open("/proc/sys/fs/dentry-state").read().split()[4])


LOOK_UP_MISSING = """
import os, sys
folder = os.path.dirname(os.__file__)   # the standard library: a host directory bound read-only
for i in range(int(input())):
    try:
        os.stat(f"{folder}/gspo-missing-{i}")
    except OSError:
        pass
print("done")
"""


def test_a_run_leaves_no_negative_dentries(code):
    # a lookup of a missing name in a bound host directory is faster the second time (a negative
    # dentry): a channel between runs. The run's cgroup was emptied only where it held file pages,
    # and a run that reads nothing left its dentries (20-39 MiB) to a later run
    if code.sandbox.cgroups is None:
        pytest.skip("without a cgroup nothing empties what a run leaves (docs/rewards.md)")
    before = _negative_dentries()
    r = code.sandbox.run(LOOK_UP_MISSING, b"30000\n", 20.0)  # gVisor: ~0.1 ms a lookup, through its Gofer
    assert r.stdout == b"done\n", r.stderr_tail
    time.sleep(0.2)
    assert _negative_dentries() - before < 10_000, (before, _negative_dentries())  # others' come and go


HOLD_LOCK = """
import fcntl, os, time
with open(os.__file__, "rb") as f:            # a host file every run may read
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
    except OSError as e:
        print("refused", e.errno, flush=True)
    time.sleep(2.0)
"""
TEST_LOCK = """
import fcntl, os, struct
with open(os.__file__, "rb") as f:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        seen = "free"
    except BlockingIOError:
        seen = "held by another run"
    except OSError as e:
        seen = f"refused {e.errno}"
    try:
        lock = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
        seen += " getlk"
    except OSError as e:
        seen += f" getlk refused {e.errno}"
print(seen)
"""


def test_no_lock_on_a_host_file_between_runs_alive_at_once(code):
    # flock on a file of the interpreter's (bound from the host, readable by every run) was a
    # channel between two runs alive at once: held or free, a bit per file
    other = CodeReward(code.settings)
    holder = []
    thread = threading.Thread(target=lambda: holder.append(other.sandbox.run(HOLD_LOCK, b"", 5.0)))
    thread.start()
    try:
        time.sleep(1.0)  # the holder's interpreter has started and taken the lock
        r = code.sandbox.run(TEST_LOCK, b"", 5.0)
    finally:
        thread.join()
    if code.settings.isolation in SHARED_KERNEL:
        assert holder[0].stdout.startswith(b"refused 37"), holder[0].stdout  # ENOLCK
        assert r.stdout == b"refused 37 getlk refused 37\n", r.stdout
    else:  # gVisor's locks are its Sentry's: another response's sandbox holds none of them
        assert holder[0].stdout.startswith(b"locked"), holder[0].stdout
        assert r.stdout.startswith(b"free"), r.stdout


def test_the_honest_path_is_exact_in_every_backend(code):
    # what closes the channels leaves an honest program whole: stdin and fn_name rows
    right = "```python\nn = int(input())\nprint(8 * n)\n```"
    wrong = "```python\nn = int(input())\nprint(8 * n + 1)\n```"
    assert (code.score(ROW, right), code.score(ROW, wrong)) == (1.0, 0.0)
    calls = {"answer": {"fn_name": "times8", "inputs": [[5], [2]], "outputs": [[40], [16]]}}
    assert code.score(calls, "```python\ndef times8(n):\n    return 8 * n\n```") == 1.0
    assert code.score(calls, "```python\ndef times8(n):\n    return 8 * n - 1\n```") == 0.0
