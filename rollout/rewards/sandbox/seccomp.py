"""System-call filters for the code sandbox's programs (seccomp BPF, built here, installed by
first_process.py just before the program's exec).

    program = build_filter(memory_unbounded=True, shared_host=False)   # bytes: struct sock_filter[]
    # first_process.py: prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog(program))

The filter is built once per sandbox, before the program's pid is known: where it names the
program's own pid (shared_host), it holds SELF_PID (and its negation) instead, and first_process.py
puts its pid there (by instruction, never by searching bytes).

What each part refuses, and why (the program sees an error: EPERM, ENOSYS, EAFNOSUPPORT or
EOPNOTSUPP, or a call that does nothing):
- always: new user namespaces (unshare, setns, clone with CLONE_NEWUSER; clone3 answers ENOSYS, so
  the C library falls back to clone, whose flags can be read), because a child user namespace
  gives the program every capability in it again; kernel surface a program has no use for
  (keyrings, which outlive the run and join runs of one user; io_uring, bpf, perf events,
  userfaultfd; AIO, whose events are one host-wide budget, fs.aio-max-nr, that one run took
  whole; inotify and fanotify, a per-user budget of 128 instances shared with every process of
  the user); sockets of any family but unix, IPv4 and IPv6 (EAFNOSUPPORT): AF_VSOCK and the
  like are not confined by the network namespace (vsock reaches the hypervisor's host), and a
  netlink socket's queue is kernel memory no cgroup counts (140 sockets filled by the kernel's
  acks: 1.1 GiB of the host's unreclaimable slab, 5 MiB in the run's cgroup); what tells a
  program which of the host's file pages are cached without reading them (preadv2 and pwritev2
  with any flag, RWF_NOWAIT among them: EOPNOTSUPP; mincore; cachestat), a channel between runs
  (one run reads pages, a later one tests them); and calls that do nothing here (answer 0):
  posix_fadvise (DONTNEED on a read-only descriptor evicts the host's page cache of that file
  for everyone), sync and syncfs (they wrote back the host's dirty pages: 307 MB, the trainer's
  checkpoints among them);
- memory_unbounded (no cgroup bounds the run): memory outside RLIMIT_AS and the tmpfs sizes
  (memfd_create, SysV shared memory, message queues, semaphores), and unix sockets (socket and
  socketpair), whose queued buffers are kernel memory outside RLIMIT_AS (GBs from one run under
  memory_mb 256); IPv4 and IPv6 stay, with nothing to reach or queue in an empty network
  namespace;
- shared_host (process mode: the host's IPC namespace, PIDs and network): every SysV IPC and POSIX
  queue call (they would reach, and outlive into, the host's); socket() of every family (the
  host's network and its unix sockets by path; a socketpair reaches nothing and stays, unless
  memory_unbounded); and whatever acts on another process, allowed on the program's own first
  process (and, where a call names one, its process group) only: signals (kill, tkill, tgkill,
  rt_sigqueueinfo, and the kernel's SIGIO on behalf of a descriptor: F_SETOWN, while F_SETOWN_EX
  and the FIOSETOWN / SIOCSPGRP ioctls, whose owner is behind a pointer, are refused), tracing
  and memory access (ptrace, process_vm_*, pidfd_*, kcmp), limits (prlimit64), priorities and
  scheduling (setpriority, never PRIO_USER; sched_setscheduler, sched_setparam, sched_setattr,
  sched_setaffinity; ioprio_set, never IOPRIO_WHO_USER) and page placement (migrate_pages,
  move_pages). A worker that is not root runs its programs as its own user: `prlimit(worker,
  RLIMIT_CPU, 1)` made every later run of that worker fail to start, and SCHED_IDLE, nice 19
  and RLIMIT_NOFILE 0 reached any process of the user, the trainer among them.

Standard library only. x86_64 and aarch64; any other architecture gets no filter (the sandbox
says so in its start-up line); a call through another ABI on these kills the program (i386) or
is refused (x32).
"""
from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR, ARCH = 0, 4
ARGS = tuple(16 + 8 * i for i in range(6))
"""Offsets of the low 32 bits of each argument (little-endian machines only)."""
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_JGE_K, BPF_RET_K, BPF_JA = 0x20, 0x15, 0x45, 0x35, 0x06, 0x05
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
CLONE_NEWUSER, CLONE_PIDFD = 0x10000000, 0x1000
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20
"""MAP_SHARED's bit is set in MAP_SHARED_VALIDATE (3) too, never in MAP_PRIVATE (2)."""
SOL_SOCKET = 1
SO_ATTACH_FILTER, SO_ATTACH_BPF, SO_ATTACH_REUSEPORT_CBPF, SO_ATTACH_REUSEPORT_EBPF = 26, 50, 51, 52
SO_COOKIE, SO_PASSPIDFD, SO_PEERPIDFD = 57, 76, 77
PR_SET_SECCOMP = 22
F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 5, 6, 7, 36, 37, 38
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
PRIO_PROCESS, PRIO_PGRP = 0, 1
IOPRIO_WHO_PROCESS, IOPRIO_WHO_PGRP = 1, 2
F_SETOWN, F_SETOWN_EX = 8, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902
X32_SYSCALL_BIT = 0x40000000
SELF_PID = 0x7EADBEEF
"""Stands for the program's pid in a filter (above PID_MAX_LIMIT, so no real pid looks like it)."""

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""The kernel's AUDIT_ARCH_* of the machines the filter knows."""

_SAME_ON_BOTH = {"pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "clone3": 435,
                 "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "cachestat": 451}
"""asm-generic numbering, which x86_64 follows too from 424 on."""
SYSCALLS = {
    "x86_64": _SAME_ON_BOTH | {
        "memfd_create": 319, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "msgget": 68,
        "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66,
        "semtimedop": 220, "mq_open": 240, "unshare": 272, "setns": 308, "clone": 56,
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "keyctl": 250,
        "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "socket": 41, "socketpair": 53, "fadvise64": 221, "io_setup": 206, "io_destroy": 207,
        "io_submit": 209, "io_cancel": 210, "io_getevents": 208, "io_pgetevents": 333,
        "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300, "sync": 162, "syncfs": 306,
        "mincore": 27, "preadv2": 327, "pwritev2": 328, "prlimit64": 302, "setpriority": 141,
        "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203, "sched_setattr": 314,
        "ioprio_set": 251, "migrate_pages": 256, "move_pages": 279, "fcntl": 72, "ioctl": 16,
        "mmap": 9, "getsockopt": 55, "setsockopt": 54, "seccomp": 317, "prctl": 157, "sysinfo": 99,
        "flock": 73, "name_to_handle_at": 303, "open_by_handle_at": 304,
    },
    "aarch64": _SAME_ON_BOTH | {
        "memfd_create": 279, "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "msgget": 186,
        "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "semget": 190, "semop": 193, "semctl": 191,
        "semtimedop": 192, "mq_open": 180, "unshare": 97, "setns": 268, "clone": 220,
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "keyctl": 219,
        "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "socket": 198, "socketpair": 199, "fadvise64": 223, "io_setup": 0, "io_destroy": 1,
        "io_submit": 2, "io_cancel": 3, "io_getevents": 4, "io_pgetevents": 292,
        "inotify_init1": 26, "fanotify_init": 262, "sync": 81, "syncfs": 267,
        "mincore": 232, "preadv2": 286, "pwritev2": 287, "prlimit64": 261, "setpriority": 140,
        "sched_setparam": 118, "sched_setscheduler": 119, "sched_setaffinity": 122, "sched_setattr": 274,
        "ioprio_set": 30, "migrate_pages": 238, "move_pages": 239, "fcntl": 25, "ioctl": 29,
        "mmap": 222, "getsockopt": 209, "setsockopt": 208, "seccomp": 277, "prctl": 167, "sysinfo": 179,
        "flock": 32, "name_to_handle_at": 264, "open_by_handle_at": 265,
    },
}

NO_USER_NAMESPACES = ("unshare", "setns")
HOST_COUNTERS = ("memfd_create", "shmget", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "name_to_handle_at",
                 "open_by_handle_at", "seccomp", "sysinfo")
"""Refused in every mode: what reads or moves a number the whole host shares (module docstring)."""
KERNEL_SURFACE = ("keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
                  "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "io_setup", "io_destroy",
                  "io_submit", "io_cancel", "io_getevents", "io_pgetevents", "inotify_init",
                  "inotify_init1", "fanotify_init", "mincore", "cachestat")
DOES_NOTHING = ("fadvise64", "sync", "syncfs")
UNBOUNDED_MEMORY = ("memfd_create", "shmget", "msgget", "semget")
HOST_IPC = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
            "semop", "semctl", "semtimedop", "mq_open")
OTHER_PROCESSES = ("pidfd_send_signal", "pidfd_open", "pidfd_getfd", "ptrace", "process_vm_readv",
                   "process_vm_writev", "kcmp")
OWN_PID_FIRST = ("prlimit64", "sched_setparam", "sched_setscheduler", "sched_setattr", "sched_setaffinity",
                 "migrate_pages", "move_pages")
"""Calls whose first argument is a pid, 0 for the caller."""


def machine() -> str | None:
    """This machine's architecture if the filter knows it, else None."""
    m = platform.machine()
    return m if m in AUDIT_ARCH else None


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _deny(nr: int, err: int) -> list[bytes]:
    return [_op(BPF_JEQ_K, nr, 0, 1), _op(BPF_RET_K, RET_ERRNO | err)]


def _only_if(nr: int, conditions: list[tuple[int, list[int]]], err: int = errno.EPERM) -> list[bytes]:
    """`nr` allowed when, for every (argument, values), the low 32 bits of that argument are one of
    the values; else the error."""
    body = []
    for arg, allowed in conditions:
        n = len(allowed)
        body += [_op(BPF_LD_W_ABS, ARGS[arg])]
        body += [_op(BPF_JEQ_K, value, n - i, 0) for i, value in enumerate(allowed)]  # to the next condition
        body += [_op(BPF_RET_K, RET_ERRNO | err)]
    body.append(_op(BPF_RET_K, RET_ALLOW))
    return [_op(BPF_JEQ_K, nr, 0, len(body))] + body


def _by_value(nr: int, arg: int, answers: dict[int, int], otherwise: int) -> list[bytes]:
    """`nr` answered by the low 32 bits of argument `arg`: answers[value] (a RET_*), else `otherwise`."""
    body = [_op(BPF_LD_W_ABS, ARGS[arg])]
    for value, answer in answers.items():
        body += [_op(BPF_JEQ_K, value, 0, 1), _op(BPF_RET_K, answer)]
    body.append(_op(BPF_RET_K, otherwise))
    return [_op(BPF_JEQ_K, nr, 0, len(body))] + body


def _refuse_when(nr: int, conditions: list[tuple[int, str, tuple[int, ...]]], answer: int) -> list[bytes]:
    """`nr` answered `answer` (a RET_*) when every condition holds, else on to the next rule. A
    condition is (argument, "in", values): its low 32 bits are one of the values; or (argument,
    "set", (bit,)): that bit of it is set."""
    # a failed condition jumps to `reload` (NR back in the accumulator, the answer jumped over),
    # each passed one to the next condition, the last to the answer
    starts, n = [], 0
    for _, how, values in conditions:
        starts.append(n)
        n += 1 + (len(values) if how == "in" else 1)
    reload, at_answer = n, n + 2
    ops: list[bytes] = []
    for c, (arg, how, values) in enumerate(conditions):
        passed = starts[c + 1] if c + 1 < len(conditions) else at_answer
        ops.append(_op(BPF_LD_W_ABS, ARGS[arg]))
        checks = values if how == "in" else values[:1]
        for j, value in enumerate(checks):
            i, last = len(ops), j == len(checks) - 1
            ops.append(_op(BPF_JEQ_K if how == "in" else BPF_JSET_K, value, passed - i - 1,
                           reload - i - 1 if last else 0))
    ops += [_op(BPF_LD_W_ABS, NR), _op(BPF_JA, 1), _op(BPF_RET_K, answer)]
    return [_op(BPF_JEQ_K, nr, 0, len(ops))] + ops


def _host_counter_rules(nr: dict[str, int]) -> list[bytes]:
    """What a run could read or move of the host's shared numbers and budgets through an argument
    (module docstring): shared anonymous mappings, socket cookies and pidfds, socket filters and
    the program's own seccomp filters (the BPF JIT budget), locks."""
    eperm, enolck = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOLCK
    ops = _refuse_when(nr["mmap"], [(3, "set", (MAP_ANONYMOUS,)), (3, "set", (MAP_SHARED,))], eperm)
    ops += _refuse_when(nr["getsockopt"], [(1, "in", (SOL_SOCKET,)), (2, "in", (SO_COOKIE, SO_PEERPIDFD))], eperm)
    ops += _refuse_when(nr["setsockopt"], [(1, "in", (SOL_SOCKET,)), (2, "in", (
        SO_ATTACH_FILTER, SO_ATTACH_BPF, SO_ATTACH_REUSEPORT_CBPF, SO_ATTACH_REUSEPORT_EBPF, SO_PASSPIDFD))], eperm)
    ops += _refuse_when(nr["prctl"], [(0, "in", (PR_SET_SECCOMP,))], eperm)
    ops += _refuse_when(nr["fcntl"], [(1, "in", (F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK,
                                                 F_OFD_SETLKW))], enolck)
    ops += _deny(nr["flock"], errno.ENOLCK)
    return ops


def _socket_rules(nr: dict[str, int], *, memory_unbounded: bool, shared_host: bool) -> list[bytes]:
    """socket() and socketpair() by family (module docstring)."""
    refused, other = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.EAFNOSUPPORT
    sockets = {family: RET_ALLOW for family in (AF_UNIX, AF_INET, AF_INET6)}
    pairs = {AF_UNIX: RET_ALLOW}
    if memory_unbounded:
        sockets[AF_UNIX] = pairs[AF_UNIX] = refused
    if shared_host:
        sockets = dict.fromkeys(sockets, refused)
    return _by_value(nr["socket"], 0, sockets, other) + _by_value(nr["socketpair"], 0, pairs, other)


def _own_processes_only(nr: dict[str, int], self_pid: int) -> list[bytes]:
    """shared_host: what acts on another process, allowed on the program's own (module docstring)."""
    own, group = [0, self_pid], [0, self_pid, -self_pid]  # the caller, the first process, its group
    ops = _only_if(nr["kill"], [(0, group)]) + _only_if(nr["tkill"], [(0, [self_pid])])
    for name in ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        ops += _only_if(nr[name], [(0, [self_pid])])
    for name in OWN_PID_FIRST:
        ops += _only_if(nr[name], [(0, own)])
    ops += _only_if(nr["setpriority"], [(0, [PRIO_PROCESS, PRIO_PGRP]), (1, own)])
    ops += _only_if(nr["ioprio_set"], [(0, [IOPRIO_WHO_PROCESS, IOPRIO_WHO_PGRP]), (1, own)])
    # fcntl(F_SETOWN, pid) names its pid; F_SETOWN_EX's owner is behind a pointer: refused
    ops += [_op(BPF_JEQ_K, nr["fcntl"], 0, 10), _op(BPF_LD_W_ABS, ARGS[1]),
            _op(BPF_JEQ_K, F_SETOWN_EX, 5, 0), _op(BPF_JEQ_K, F_SETOWN, 0, 5), _op(BPF_LD_W_ABS, ARGS[2])]
    ops += [_op(BPF_JEQ_K, value, 3 - i, 0) for i, value in enumerate(group)]
    ops += [_op(BPF_RET_K, RET_ERRNO | errno.EPERM), _op(BPF_RET_K, RET_ALLOW)]
    ops += _by_value(nr["ioctl"], 1, dict.fromkeys((FIOSETOWN, SIOCSPGRP), RET_ERRNO | errno.EPERM), RET_ALLOW)
    return ops


def build_filter(*, memory_unbounded: bool, shared_host: bool, self_pid: int = SELF_PID,
                 arch: str | None = None) -> bytes | None:
    """The filter (module docstring) as struct sock_filter[] bytes, or None on an unknown machine.
    self_pid: the program's first process (shared_host: the one it may act on, with its group)."""
    arch = arch or machine()
    if arch is None:
        return None
    nr = SYSCALLS[arch]
    ops = [_op(BPF_LD_W_ABS, ARCH), _op(BPF_JEQ_K, AUDIT_ARCH[arch], 1, 0),
           _op(BPF_RET_K, RET_KILL_PROCESS), _op(BPF_LD_W_ABS, NR)]
    if arch == "x86_64":  # the x32 ABI reaches the same calls under other numbers
        ops += [_op(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1), _op(BPF_RET_K, RET_ERRNO | errno.ENOSYS)]
    denied = list(NO_USER_NAMESPACES) + list(KERNEL_SURFACE) + list(HOST_COUNTERS)
    if memory_unbounded:
        denied += UNBOUNDED_MEMORY
    if shared_host:
        denied += list(HOST_IPC) + list(OTHER_PROCESSES)
    for name in dict.fromkeys(denied):
        if name in nr:  # inotify_init: x86_64 only
            ops += _deny(nr[name], errno.EPERM)
    ops += _deny(nr["clone3"], errno.ENOSYS)
    for name in DOES_NOTHING:
        ops += _deny(nr[name], 0)  # errno 0: the call "succeeds" without running
    for name in ("preadv2", "pwritev2"):  # flags, the sixth argument: none (RWF_NOWAIT tells what is cached)
        ops += _only_if(nr[name], [(5, [0])], errno.EOPNOTSUPP)
    ops += _socket_rules(nr, memory_unbounded=memory_unbounded, shared_host=shared_host)
    ops += _host_counter_rules(nr)
    # clone: everything but a new user namespace or a pidfd (threads and forks pass)
    ops += [_op(BPF_JEQ_K, nr["clone"], 0, 4), _op(BPF_LD_W_ABS, ARGS[0]),
            _op(BPF_JSET_K, CLONE_NEWUSER | CLONE_PIDFD, 0, 1),
            _op(BPF_RET_K, RET_ERRNO | errno.EPERM), _op(BPF_RET_K, RET_ALLOW)]
    if shared_host:
        ops += _own_processes_only(nr, self_pid)
    ops.append(_op(BPF_RET_K, RET_ALLOW))
    return b"".join(ops)
