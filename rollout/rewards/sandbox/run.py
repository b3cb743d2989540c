"""Run an untrusted Python program on one input, bounded and isolated (for `reward: code`).

    sandbox = Sandbox(CodeSandboxSettings())        # probes what this machine allows, once
    result = sandbox.run(program_text, stdin=b"3 4\\n", time_limit_s=2.0)
    result.status, result.stdout                     # "ok" | "runtime_error" | "timeout" | "output_limit"

Each run is a fresh process tree; what it isolates depends on the machine (docs/rewards.md has the
table, and tests/rollout/rewards/test_sandbox.py a test per promise). The adversary is the policy
being trained: anything a program can reach that tells it the expected output, or that stops the
run, it will learn to use.

namespaces (auto and namespaces: where user namespaces are allowed)
- fresh user, mount, PID, network, IPC, UTS and cgroup namespaces per run (util-linux `unshare`);
  as root, made as the unprivileged user nobody (util-linux `setpriv`), so the program's "root" is
  nobody outside;
- a root built from an allow-list (first_process.py): the interpreter's directories read-only, five
  device nodes, a fresh /proc, a private /tmp and /dev/shm; nothing else of the host (no project,
  run folders, data, sockets, /sys, /home, /root, /var, /run); pivot_root, the old root detached;
- no network (a network namespace with only a down loopback), no SysV IPC or hostname shared with
  the host or another run, no nested user namespace (max_user_namespaces 0 inside, and the filter);
- no other process visible; when the run ends or is killed, the kernel kills every process of its
  PID namespace (nothing escapes by double-forking or setsid);
- every capability dropped, no_new_privs, a system-call filter (seccomp.py).
process (only when isolation: process is set; auto never falls back to it)
- a process group of its own (killed whole), limits, a private folder (0700) as the working
  directory, as root a user of the reward worker's own (process_mode.py: it cannot signal,
  trace or read the worker, nor enter a concurrent run's folder); Landlock where the kernel has it
  (reads beneath the interpreter's directories and /proc only, writes beneath its folder only),
  else as root what its user left in the host's temp directories removed after the run; the
  filter refuses SysV IPC, sockets (socketpair stays), and signals and tracing of any process but
  its own; the host's PID, IPC and UTS namespaces, and without Landlock its file system. Said
  once at start.
Both: per test, a cgroup (cgroup.py) bounds memory (tmpfs, shared memory and memfd
included), processes and CPU of the whole run where one can be made; else the filter refuses
memfd_create, SysV IPC and unix and netlink sockets, and the process and descriptor counts are
lowered to FALLBACK_PROCESSES and FALLBACK_FILES. And RLIMIT_CPU,
RLIMIT_AS (memory per process), RLIMIT_FSIZE, RLIMIT_NPROC, no core files; a wall-clock limit; stdout
capped (the program is killed past it); stdin from the test, never the expected output. It is not
a VM: the kernel is shared, and a kernel exploit is out of its scope.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gspo_errors import GspoError
from rollout.rewards.sandbox.cgroup import CgroupLayout, RunCgroup
from rollout.rewards.sandbox.process_mode import (FOLDER_PREFIX, landlock_abi, remove_folder, remove_left_behind,
                                             remove_stale_folders, run_user)
from rollout.rewards.sandbox.seccomp import SELF_PID, build_filter
from rollout.rewards.settings import INTERPRETER_START_S, CodeSandboxSettings

INIT_SOURCE = (Path(__file__).parent / "first_process.py").read_text()
SET_UP_LIMIT_S = 10.0
"""Bound on the sandbox's own set-up (namespaces, mounts), before the program's clock starts."""
STDERR_TAIL = 4096
NOBODY = 65534
SANDBOX_ENV = "GSPO_SANDBOX"
"""Set in every sandboxed process's environment (to the Sandbox's tag): how a check finds leftovers."""
FALLBACK_PROCESSES = 4
"""Processes (and threads) a run may have where no cgroup bounds it: memory is then bounded per
process only, so the whole run holds at most this many x memory_mb (plus its tmpfs)."""
FILES, FALLBACK_FILES = 256, 64
"""Open descriptors per process (RLIMIT_NOFILE), and where no cgroup counts the kernel memory
behind each (pipe buffers: the user's pipe-user-pages-soft bounds those)."""
PROBE_TRIES = 3
"""Runs of the probe's program per interpreter before it counts as not running: a probe that
meets something else once (a run beside it) is not a sandbox that cannot work."""
TMP_MB, SHM_MB = 64, 16
"""Sizes of the run's private /tmp (its working directory) and /dev/shm (namespaces mode)."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
PREFERRED_PYTHON = "/usr/bin/python3"
"""The system's interpreter lives under /usr, so the root needs nothing else for it."""


class SandboxUnavailable(GspoError, RuntimeError):
    """The sandbox cannot run here as configured (no namespaces where they are required, no
    interpreter the sandbox user can run); the message says why and what to set."""


@dataclasses.dataclass
class RunResult:
    status: str
    """ok (exit 0), runtime_error (non-zero exit, killed by a signal), timeout (wall or CPU limit,
    or the caller's deadline), output_limit (stdout past max_output_bytes), sandbox_error (ours)."""
    stdout: bytes
    stderr_tail: bytes
    returncode: int | None
    seconds: float


def root_plan(python: str) -> list[list[str]]:
    """What the new root holds (first_process.build_root): ["dir", path] bound read-only,
    ["link", path, target] recreated, ["file" | "dev", path] a host file bound onto an empty one."""
    plan: list[list[str]] = []
    for top in SYSTEM_DIRS:
        if os.path.islink(top):
            plan.append(["link", top, os.readlink(top)])
        elif os.path.isdir(top):
            plan.append(["dir", top])
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    covered = [p[1] for p in plan if p[0] == "dir"] + [os.path.realpath(p[1]) for p in plan if p[0] == "link"]
    if prefix != "/" and not any(prefix == d or prefix.startswith(d + "/") for d in covered):
        plan.append(["dir", prefix])  # an interpreter installed elsewhere (conda, pyenv): its prefix only
    if os.path.isfile("/etc/ld.so.cache"):
        plan.append(["file", "/etc/ld.so.cache"])
    plan += [["dev", f"/dev/{d}"] for d in DEVICES if os.path.exists(f"/dev/{d}")]
    return plan


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGKILL when the reward worker dies (then `unshare --kill-child`
    takes the whole PID namespace with it)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[-limit:]


class Sandbox:
    """One per reward worker; `mode`, `python` and the bounds are settled by the first run's probe."""

    def __init__(self, settings: CodeSandboxSettings) -> None:
        self.settings = settings
        self.mode: str | None = None
        self.python: str | None = None
        self.note = ""
        self.tag = f"{os.getpid()}-{id(self):x}"
        self.cgroups: CgroupLayout | None = None
        self.root: list[list[str]] = []
        self._filter: bytes | None = None
        self.uid: int | None = None
        """process mode: the runs' user (root: this worker's own), None: the worker's."""
        self.landlock = 0
        """process mode: the Landlock ABI that confines the runs' files, 0: none."""

    # --- what this machine allows --------------------------------------------------------------
    def _prefix(self, mode: str) -> list[str]:
        if mode != "namespaces":
            return []
        # setpriv's uid change clears the parent-death signal: --pdeathsig sets it again
        drop = (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--pdeathsig=KILL"]
                if os.geteuid() == 0 else [])
        return drop + ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
                       "--mount", "--mount-proc", "--ipc", "--uts", "--cgroup", "--"]

    def _candidates(self) -> list[str]:
        if self.settings.python:
            return [self.settings.python]
        found = [PREFERRED_PYTHON, sys.executable, shutil.which("python3") or ""]
        return list(dict.fromkeys(os.path.realpath(p) for p in found if p and os.path.exists(p)))

    def probe(self) -> str:
        """Settle mode, interpreter and bounds with a trivial program (SandboxUnavailable if
        nothing works); returns a one-line description for the run's start-up output."""
        if self.mode is not None:
            return self.note
        wanted = self.settings.isolation
        mode = "process" if wanted == "process" else "namespaces"
        self.cgroups = CgroupLayout.find()
        self._filter = build_filter(memory_unbounded=self.cgroups is None, shared_host=mode == "process")
        if mode == "process":
            self.uid, self.landlock = run_user(), landlock_abi()
            if self.uid is not None:
                remove_stale_folders(time.monotonic() + SET_UP_LIMIT_S)
        reasons = []
        for python in self._candidates():
            self.mode, self.python, self.root = mode, python, root_plan(python)
            for _ in range(PROBE_TRIES):
                r = self._run_once("print(6 * 7)", b"", 10.0)
                if r.status == "ok" and r.stdout.strip() == b"42":
                    self.note = self._describe()
                    return self.note
            reasons.append(f"{python}: {r.status} {_one_line(r.stderr_tail.decode(errors='replace'))}")
        self.mode = self.python = None
        if mode == "process":
            raise SandboxUnavailable(f"rollout.code_sandbox.isolation='process': no interpreter runs here: "
                                     + "; ".join(reasons))
        raise SandboxUnavailable(
            f"rollout.code_sandbox.isolation={wanted!r}: the sandbox's namespaces cannot be made here "
            f"({'; '.join(reasons)}){_userns_hint()}; set rollout.code_sandbox.isolation: process to run "
            "programs with process isolation only (weaker: no file-system, network or IPC isolation)")

    def _describe(self) -> str:
        if self.cgroups is not None:
            bounds = self.cgroups.describe()
        else:
            bounds = (f"no cgroup here: memory bounded per process, at most {self._processes()} processes, "
                      "memfd, SysV IPC and unix sockets refused")
        if self._filter is None:
            bounds += f"; no system-call filter on {os.uname().machine}"
        if self.mode == "namespaces":
            return (f"code sandbox: namespaces (a root of the interpreter's read-only directories, no network, "
                    f"private /tmp, IPC and hostname, no nested user namespaces), {bounds}, {self.python}")
        user = f"as uid {self.uid}" if self.uid is not None else "as the worker's user"
        if self.landlock:
            files = (f"files confined by Landlock (ABI {self.landlock}: reads of the interpreter's directories, "
                     "writes in its folder)")
        elif self.uid is not None:
            files = ("NO file-system isolation (no Landlock in this kernel; what its user leaves in /tmp, "
                     "/var/tmp and /dev/shm is removed)")
        else:
            files = "NO file-system isolation (no Landlock in this kernel)"
        return (f"code sandbox: process isolation only (rollout.code_sandbox.isolation: process): the host's "
                f"processes visible, sockets refused, {user}, {files}, {bounds}, {self.python}")

    # --- one run -------------------------------------------------------------------------------
    def run(self, program: str, stdin: bytes, time_limit_s: float | None = None,
            deadline: float | None = None) -> RunResult:
        """The program on one input, within the limits (module docstring), and over by `deadline`
        (time.monotonic()) whatever the limit, set-up included: then its status is "timeout"."""
        self.probe()
        return self._run_once(program, stdin, time_limit_s or self.settings.time_limit_s, deadline)

    def _processes(self) -> int:
        s = self.settings
        return s.max_processes if self.cgroups is not None else min(s.max_processes, FALLBACK_PROCESSES)

    def _limits(self, time_limit_s: float) -> dict[str, int]:
        s = self.settings
        # a backstop past the wall limit, which decides "timeout" (CPU counts per process)
        cpu = math.ceil(time_limit_s + INTERPRETER_START_S) + 1
        return {"RLIMIT_CPU": cpu, "RLIMIT_AS": s.memory_mb << 20, "RLIMIT_FSIZE": s.max_file_mb << 20,
                "RLIMIT_NPROC": self._processes(), "RLIMIT_CORE": 0,
                "RLIMIT_NOFILE": FILES if self.cgroups is not None else FALLBACK_FILES, "RLIMIT_MSGQUEUE": 0}

    def _run_once(self, program: str, stdin: bytes, time_limit_s: float,
                  deadline: float | None = None) -> RunResult:
        t0 = time.monotonic()
        hard = min(deadline or math.inf, t0 + SET_UP_LIMIT_S + time_limit_s + INTERPRETER_START_S)
        # the whole run in one cgroup, the sandbox's own unshare process included (+1)
        cgroup = (self.cgroups.create(self.settings.memory_mb << 20, self.settings.max_processes + 1)
                  if self.cgroups is not None else None)
        program_fd = os.memfd_create("program")
        os.write(program_fd, program.encode(errors="surrogatepass"))  # a lone surrogate: a SyntaxError, not ours
        os.lseek(program_fd, 0, os.SEEK_SET)
        status_r, status_w = os.pipe()
        config = {"mode": self.mode, "program_fd": program_fd, "status_fd": status_w, "python": self.python,
                  "limits": self._limits(time_limit_s), "root": self.root, "tmp_mb": TMP_MB, "shm_mb": SHM_MB,
                  "seccomp": self._filter.hex() if self._filter else None, "self_pid": SELF_PID,
                  "uid": self.uid, "landlock": self.landlock}
        argv = self._prefix(self.mode) + [self.python, "-I", "-S", "-c", INIT_SOURCE, json.dumps(config)]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(program_fd, status_w), start_new_session=True,
                                    preexec_fn=_in_child(cgroup),
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", SANDBOX_ENV: self.tag})
        except BaseException:
            os.close(status_r)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            os.close(program_fd)
            os.close(status_w)
        try:
            stdout, stderr, status, overflow, timed_out = self._communicate(
                proc, stdin, status_r, time_limit_s + INTERPRETER_START_S, hard)
        finally:
            os.close(status_r)
            _kill_group(proc)
            if cgroup is not None:
                cgroup.remove()  # and with it whatever escaped the process group (process mode)
        seconds = time.monotonic() - t0
        if self.mode == "process":
            self._clean_up(status[3:].strip() if status.startswith("ok ") else "", deadline or math.inf)
        tail = stderr[-STDERR_TAIL:]
        if not status.startswith("ok"):
            if timed_out and deadline is not None and time.monotonic() >= deadline:
                return RunResult("timeout", b"", tail, proc.returncode, seconds)  # the caller's time ran out
            return RunResult("sandbox_error", b"", tail, proc.returncode, seconds)
        if overflow:
            return RunResult("output_limit", stdout, tail, proc.returncode, seconds)
        if timed_out:
            return RunResult("timeout", stdout, tail, proc.returncode, seconds)
        return RunResult("ok" if proc.returncode == 0 else "runtime_error", stdout, tail, proc.returncode, seconds)

    def _clean_up(self, folder: str, until: float) -> None:
        """Process mode, after the run: its folder, and as root without Landlock what its user left in
        the host's temp directories, removed within the caller's deadline (process_mode.py)."""
        if folder.startswith(f"/tmp/{FOLDER_PREFIX}"):
            remove_folder(folder, until)
        if self.uid is not None and not self.landlock:
            remove_left_behind(self.uid, until, keep=folder)

    def _communicate(self, proc: subprocess.Popen, stdin: bytes, status_r: int,
                     limit_s: float, hard: float) -> tuple[bytes, bytes, str, bool, bool]:
        """Feed stdin, read stdout (capped) and stderr (tail) until exit, the cap, `limit_s` after
        the set-up said "ok" (SET_UP_LIMIT_S before it), or `hard`, whichever comes first."""
        cap = self.settings.max_output_bytes
        out, err, status = bytearray(), bytearray(), bytearray()
        pending = memoryview(stdin)
        readers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        for fd in readers:
            os.set_blocking(fd, False)
        writer = proc.stdin.fileno()
        os.set_blocking(writer, False)
        if not pending:
            proc.stdin.close()
            writer = None
        overflow = timed_out = False
        deadline, started = min(time.monotonic() + SET_UP_LIMIT_S, hard), False
        while readers or writer is not None:
            if not started and status.endswith(b"\n"):
                # the program's clock starts at its exec
                deadline, started = min(time.monotonic() + limit_s, hard), True
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            r, w, _ = select.select(list(readers), [writer] if writer is not None else [], [], left)
            if w:
                try:
                    pending = pending[os.write(writer, pending[:65536]):]
                except (BrokenPipeError, BlockingIOError):
                    pending = pending[len(pending):]
                if not pending:
                    proc.stdin.close()
                    writer = None
            for fd in r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del readers[fd]
                    continue
                buf = readers[fd]
                buf += chunk
                if fd == proc.stderr.fileno() and len(buf) > 4 * STDERR_TAIL:
                    del buf[:-STDERR_TAIL]
                if fd == proc.stdout.fileno() and len(buf) > cap:
                    overflow = True
            if overflow:
                break
        if not (overflow or timed_out):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        return bytes(out[:cap]), bytes(err), status.decode(errors="replace"), overflow, timed_out


def _in_child(cgroup: RunCgroup | None):
    """What the run's first process does between fork and exec: die with the worker, join the
    run's cgroup (before anything of the program runs, so nothing it starts is outside it)."""
    def child() -> None:
        _set_parent_death_signal()
        if cgroup is not None:
            cgroup.join()
    return child


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (with namespaces, unshare's death takes its PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    proc.wait()


def _userns_hint() -> str:
    try:
        n = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        return ""
    return " (user namespaces are disabled on this machine: /proc/sys/user/max_user_namespaces = 0)" if n == 0 else ""
