"""Run an untrusted Python program on one input, bounded and isolated (for `reward: code`).

    sandbox = Sandbox(CodeSandboxSettings())        # probes what this machine allows, once
    result = sandbox.run(program_text, stdin=b"3 4\\n", time_limit_s=2.0)
    result.status, result.stdout                     # "ok" | "runtime_error" | "timeout" | "output_limit"

Each run is a fresh process tree; what it isolates depends on the machine (docs/rewards.md has the
table, and tests/rollout/rewards/test_sandbox.py a test per promise):

namespaces (where user namespaces are allowed: unprivileged `unshare --user` works)
- fresh user, mount, PID and network namespaces per run (util-linux `unshare`); as root, the
  namespaces are made as the unprivileged user nobody (util-linux `setpriv`), so the program's
  "root" is nobody outside and reads only what nobody may;
- no network: a network namespace with only a down loopback (connect fails at once);
- the file system read-only; a private 64 MiB tmpfs on /tmp (its working directory), /var/tmp and
  /dev/shm, gone with it; /root and /home hidden;
- no other process visible; when the run ends or is killed, the kernel kills every process of its
  PID namespace (nothing escapes by double-forking or setsid);
- every capability dropped and no_new_privs set before the program starts.
process (auto's fallback where namespaces are not allowed, or isolation: process)
- a process group of its own (killed whole), limits, a private temporary directory as the working
  directory, the user nobody when started as root; NO network and NO file-system isolation, and a
  child that calls setsid escapes the kill. Said once at start.
Both: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE, RLIMIT_NPROC (a fork bomb stops there; not
enforced for root in process mode), no core files; a wall-clock limit; stdout capped (the program is
killed past it); stdin from the test, never the expected output. It is not a VM: the kernel is
shared, and a kernel exploit is out of its scope.
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
import time
from pathlib import Path

from gspo_megatron import GspoError
from rollout.rewards.settings import CodeSandboxSettings

INIT_SOURCE = (Path(__file__).parent / "sandbox_init.py").read_text()
SET_UP_LIMIT_S = 10.0
"""Bound on the sandbox's own set-up (namespaces, mounts), before the program's clock starts."""
INTERPRETER_START_S = 0.5
"""Added to a test's time limit for the interpreter's start (~30-60 ms here)."""
STDERR_TAIL = 4096
NOBODY = 65534
SANDBOX_ENV = "GSPO_SANDBOX"
"""Set in every sandboxed process's environment (to the Sandbox's tag): how a check finds leftovers."""


class SandboxUnavailable(GspoError, RuntimeError):
    """The sandbox cannot run here as configured (isolation: namespaces where they are not allowed,
    no interpreter the sandbox user can run); the message says why."""


@dataclasses.dataclass
class RunResult:
    status: str
    """ok (exit 0), runtime_error (non-zero exit, killed by a signal), timeout (wall or CPU limit),
    output_limit (stdout past max_output_bytes)."""
    stdout: bytes
    stderr_tail: bytes
    returncode: int | None
    seconds: float


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGKILL when the reward worker dies (then `unshare --kill-child`
    takes the whole PID namespace with it)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Sandbox:
    """One per reward worker; `mode` and `python` are settled by the first run's probe."""

    def __init__(self, settings: CodeSandboxSettings) -> None:
        self.settings = settings
        self.mode: str | None = None
        self.python: str | None = None
        self.note = ""
        self.tag = f"{os.getpid()}-{id(self):x}"

    # --- what this machine allows --------------------------------------------------------------
    def _prefix(self, mode: str) -> list[str]:
        if mode != "namespaces":
            return []
        # setpriv's uid change clears the parent-death signal: --pdeathsig sets it again
        drop = (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--pdeathsig=KILL"]
                if os.geteuid() == 0 else [])
        return drop + ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
                       "--mount", "--mount-proc", "--"]

    def _candidates(self) -> list[str]:
        if self.settings.python:
            return [self.settings.python]
        import sys
        found = [os.path.realpath(sys.executable), shutil.which("python3") or "", "/usr/bin/python3"]
        return list(dict.fromkeys(p for p in found if p))

    def probe(self) -> str:
        """Settle mode and interpreter with a trivial program (SandboxUnavailable if nothing works);
        returns a one-line description for the run's start-up output."""
        if self.mode is not None:
            return self.note
        wanted = self.settings.isolation
        modes = ["namespaces", "process"] if wanted == "auto" else [wanted]
        reasons = []
        for mode in modes:
            for python in self._candidates():
                self.mode, self.python = mode, python
                r = self._run_once("print(6 * 7)", b"", 10.0)
                if r.status == "ok" and r.stdout.strip() == b"42":
                    self.note = self._describe(mode, python, reasons)
                    return self.note
                reasons.append(f"{mode} with {python}: {r.status} "
                               f"{r.stderr_tail.decode(errors='replace').strip()[-300:]}")
        self.mode = self.python = None
        raise SandboxUnavailable(f"rollout.code_sandbox.isolation={wanted!r}: no sandbox runs here: "
                                 + "; ".join(reasons) + _userns_hint())

    @staticmethod
    def _describe(mode: str, python: str, reasons: list[str]) -> str:
        if mode == "namespaces":
            return f"code sandbox: namespaces (no network, read-only file system, private /tmp), {python}"
        why = f" ({reasons[0]})" if reasons else ""
        return (f"code sandbox: process isolation only: NO network or file-system isolation here{why}"
                f"{_userns_hint()}; {python}")

    # --- one run -------------------------------------------------------------------------------
    def run(self, program: str, stdin: bytes, time_limit_s: float | None = None) -> RunResult:
        """The program on one input, within the limits (module docstring)."""
        self.probe()
        return self._run_once(program, stdin, time_limit_s or self.settings.time_limit_s)

    def _limits(self, time_limit_s: float) -> dict[str, int]:
        s = self.settings
        # a backstop past the wall limit, which decides "timeout" (CPU counts per process)
        cpu = math.ceil(time_limit_s + INTERPRETER_START_S) + 1
        return {"RLIMIT_CPU": cpu, "RLIMIT_AS": s.memory_mb << 20, "RLIMIT_FSIZE": s.max_file_mb << 20,
                "RLIMIT_NPROC": s.max_processes, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": 256}

    def _run_once(self, program: str, stdin: bytes, time_limit_s: float) -> RunResult:
        program_fd = os.memfd_create("program")
        os.write(program_fd, program.encode())
        os.lseek(program_fd, 0, os.SEEK_SET)
        status_r, status_w = os.pipe()
        config = {"mode": self.mode, "program_fd": program_fd, "status_fd": status_w, "python": self.python,
                  "limits": self._limits(time_limit_s)}
        argv = self._prefix(self.mode) + [self.python, "-I", "-S", "-c", INIT_SOURCE, json.dumps(config)]
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(program_fd, status_w), start_new_session=True,
                                    preexec_fn=_set_parent_death_signal,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", SANDBOX_ENV: self.tag})
        finally:
            os.close(program_fd)
            os.close(status_w)
        try:
            stdout, stderr, status, overflow, timed_out = self._communicate(
                proc, stdin, status_r, time_limit_s + INTERPRETER_START_S)
        finally:
            os.close(status_r)
            _kill_group(proc)
        seconds = time.monotonic() - t0
        workdir = status[3:].strip() if status.startswith("ok ") else ""
        if self.mode == "process" and workdir.startswith("/tmp/gspo-sandbox-"):
            shutil.rmtree(workdir, ignore_errors=True)
        tail = stderr[-STDERR_TAIL:]
        if not status.startswith("ok"):
            return RunResult("sandbox_error", b"", tail, proc.returncode, seconds)
        if overflow:
            return RunResult("output_limit", stdout, tail, proc.returncode, seconds)
        if timed_out:
            return RunResult("timeout", stdout, tail, proc.returncode, seconds)
        return RunResult("ok" if proc.returncode == 0 else "runtime_error", stdout, tail, proc.returncode, seconds)

    def _communicate(self, proc: subprocess.Popen, stdin: bytes, status_r: int,
                     limit_s: float) -> tuple[bytes, bytes, str, bool, bool]:
        """Feed stdin, read stdout (capped) and stderr (tail) until exit, the cap, or `limit_s`
        after the set-up said "ok" (SET_UP_LIMIT_S before it)."""
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
        deadline, started = time.monotonic() + SET_UP_LIMIT_S, False
        while readers or writer is not None:
            if not started and status.endswith(b"\n"):
                deadline, started = time.monotonic() + limit_s, True  # the program's clock starts at its exec
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            r, w, _ = select.select(list(readers), [writer] if writer is not None else [], [], left)
            if w:
                try:
                    pending = pending[os.write(writer, pending[:65536]):]
                except (BrokenPipeError, BlockingIOError):
                    pending = pending[:0] if not isinstance(pending, memoryview) else pending[len(pending):]
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
