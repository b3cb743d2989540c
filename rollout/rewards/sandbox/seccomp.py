"""System-call filters for the code sandbox's programs (seccomp BPF, built here, installed by
first_process.py just before the program's exec).

    program = build_filter(memory_unbounded=True, shared_host=False)   # bytes: struct sock_filter[]
    # first_process.py: prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog(program))

The filter is built once per sandbox, before the program's pid is known: where it names the
program's own pid (shared_host), it holds SELF_PID (and its negation) instead, and first_process.py
puts its pid there (by instruction, never by searching bytes).

What each part refuses, and why (the program sees an error: EPERM, ENOSYS or EAFNOSUPPORT):
- always: new user namespaces (unshare, setns, clone with CLONE_NEWUSER; clone3 answers ENOSYS, so
  the C library falls back to clone, whose flags can be read), because a child user namespace
  gives the program every capability in it again; kernel surface a program has no use for
  (keyrings, which outlive the run and join runs of one user; io_uring, bpf, perf events,
  userfaultfd); sockets of any family but unix, IPv4, IPv6 and netlink (EAFNOSUPPORT): AF_VSOCK
  and the like are not confined by the network namespace (vsock reaches the hypervisor's host);
  and posix_fadvise does nothing (answers 0): DONTNEED on a read-only descriptor evicts the
  host's page cache of that file for everyone;
- memory_unbounded (no cgroup bounds the run): memory outside RLIMIT_AS and the tmpfs sizes
  (memfd_create, SysV shared memory, message queues, semaphores), and unix and netlink sockets
  (socket and socketpair), whose queued buffers are kernel memory outside RLIMIT_AS (GBs from one
  run under memory_mb 256); IPv4 and IPv6 stay, with nothing to reach or queue in an empty network
  namespace;
- shared_host (process mode: the host's IPC namespace, PIDs and network): every SysV IPC and POSIX
  queue call (they would reach, and outlive into, the host's); socket() of every family (the
  host's network and its unix sockets by path; a socketpair reaches nothing and stays, unless
  memory_unbounded); and signals, tracing and memory access to any process but the program's own
  first process and its process group: not the reward worker, which runs as the same user
  unless the worker is root.

Standard library only. x86_64 and aarch64; any other architecture gets no filter (the sandbox
says so in its start-up line); a call through another ABI on these kills the program (i386) or
is refused (x32).
"""
from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR, ARCH, ARG0, ARG1 = 0, 4, 16, 24
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
CLONE_NEWUSER = 0x10000000
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
X32_SYSCALL_BIT = 0x40000000
SELF_PID = 0x7EADBEEF
"""Stands for the program's pid in a filter (above PID_MAX_LIMIT, so no real pid looks like it)."""

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""The kernel's AUDIT_ARCH_* of the machines the filter knows."""

SYSCALLS = {
    "x86_64": {
        "memfd_create": 319, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "msgget": 68,
        "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66,
        "semtimedop": 220, "mq_open": 240, "unshare": 272, "setns": 308, "clone": 56, "clone3": 435,
        "kill": 62, "tkill": 200, "tgkill": 234, "pidfd_send_signal": 424, "pidfd_open": 434,
        "pidfd_getfd": 438, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "kcmp": 312, "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "socket": 41, "socketpair": 53, "fadvise64": 221,
    },
    "aarch64": {
        "memfd_create": 279, "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "msgget": 186,
        "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "semget": 190, "semop": 193, "semctl": 191,
        "semtimedop": 192, "mq_open": 180, "unshare": 97, "setns": 268, "clone": 220, "clone3": 435,
        "kill": 129, "tkill": 130, "tgkill": 131, "pidfd_send_signal": 424, "pidfd_open": 434,
        "pidfd_getfd": 438, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "kcmp": 272, "keyctl": 219, "add_key": 217, "request_key": 218, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "socket": 198, "socketpair": 199, "fadvise64": 223,
    },
}

NO_USER_NAMESPACES = ("unshare", "setns")
KERNEL_SURFACE = ("keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
                  "io_uring_register", "bpf", "perf_event_open", "userfaultfd")
UNBOUNDED_MEMORY = ("memfd_create", "shmget", "msgget", "semget")
HOST_IPC = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
            "semop", "semctl", "semtimedop", "mq_open")
OTHER_PROCESSES = ("pidfd_send_signal", "pidfd_open", "pidfd_getfd", "ptrace", "process_vm_readv",
                   "process_vm_writev", "kcmp")


def machine() -> str | None:
    """This machine's architecture if the filter knows it, else None."""
    m = platform.machine()
    return m if m in AUDIT_ARCH else None


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _deny(nr: int, err: int) -> list[bytes]:
    return [_op(BPF_JEQ_K, nr, 0, 1), _op(BPF_RET_K, RET_ERRNO | err)]


def _only_at(nr: int, arg: int, allowed: list[int]) -> list[bytes]:
    """`nr` allowed when the low 32 bits of argument `arg` are one of `allowed`, else EPERM."""
    n = len(allowed)
    body = [_op(BPF_LD_W_ABS, arg)]
    body += [_op(BPF_JEQ_K, value, n - i, 0) for i, value in enumerate(allowed)]  # to RET_ALLOW
    body += [_op(BPF_RET_K, RET_ERRNO | errno.EPERM), _op(BPF_RET_K, RET_ALLOW)]
    return [_op(BPF_JEQ_K, nr, 0, len(body))] + body


def _by_value(nr: int, arg: int, answers: dict[int, int], otherwise: int) -> list[bytes]:
    """`nr` answered by the low 32 bits of argument `arg`: answers[value] (a RET_*), else `otherwise`."""
    body = [_op(BPF_LD_W_ABS, arg)]
    for value, answer in answers.items():
        body += [_op(BPF_JEQ_K, value, 0, 1), _op(BPF_RET_K, answer)]
    body.append(_op(BPF_RET_K, otherwise))
    return [_op(BPF_JEQ_K, nr, 0, len(body))] + body


def _socket_rules(nr: dict[str, int], *, memory_unbounded: bool, shared_host: bool) -> list[bytes]:
    """socket() and socketpair() by family (module docstring)."""
    refused, other = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.EAFNOSUPPORT
    sockets = {family: RET_ALLOW for family in (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)}
    pairs = {AF_UNIX: RET_ALLOW}
    if memory_unbounded:
        sockets[AF_UNIX] = sockets[AF_NETLINK] = pairs[AF_UNIX] = refused
    if shared_host:
        sockets = dict.fromkeys(sockets, refused)
    return _by_value(nr["socket"], ARG0, sockets, other) + _by_value(nr["socketpair"], ARG0, pairs, other)


def build_filter(*, memory_unbounded: bool, shared_host: bool, self_pid: int = SELF_PID,
                 arch: str | None = None) -> bytes | None:
    """The filter (module docstring) as struct sock_filter[] bytes, or None on an unknown machine.
    self_pid: the program's first process (shared_host: the one it may signal, with its group)."""
    arch = arch or machine()
    if arch is None:
        return None
    nr = SYSCALLS[arch]
    ops = [_op(BPF_LD_W_ABS, ARCH), _op(BPF_JEQ_K, AUDIT_ARCH[arch], 1, 0),
           _op(BPF_RET_K, RET_KILL_PROCESS), _op(BPF_LD_W_ABS, NR)]
    if arch == "x86_64":  # the x32 ABI reaches the same calls under other numbers
        ops += [_op(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1), _op(BPF_RET_K, RET_ERRNO | errno.ENOSYS)]
    denied = list(NO_USER_NAMESPACES) + list(KERNEL_SURFACE)
    if memory_unbounded:
        denied += UNBOUNDED_MEMORY
    if shared_host:
        denied += list(HOST_IPC) + list(OTHER_PROCESSES)
    for name in dict.fromkeys(denied):
        ops += _deny(nr[name], errno.EPERM)
    ops += _deny(nr["clone3"], errno.ENOSYS)
    ops += _deny(nr["fadvise64"], 0)  # errno 0: the call "succeeds" without running
    ops += _socket_rules(nr, memory_unbounded=memory_unbounded, shared_host=shared_host)
    # clone: everything but a new user namespace (threads and forks pass)
    ops += [_op(BPF_JEQ_K, nr["clone"], 0, 4), _op(BPF_LD_W_ABS, ARG0), _op(BPF_JSET_K, CLONE_NEWUSER, 0, 1),
            _op(BPF_RET_K, RET_ERRNO | errno.EPERM), _op(BPF_RET_K, RET_ALLOW)]
    if shared_host:
        ours = [0, self_pid, -self_pid]  # kill(0), itself, its own process group
        ops += _only_at(nr["kill"], ARG0, ours)
        ops += _only_at(nr["tkill"], ARG0, [self_pid])
        ops += _only_at(nr["tgkill"], ARG0, [self_pid])
    ops.append(_op(BPF_RET_K, RET_ALLOW))
    return b"".join(ops)
