"""The code sandbox's gVisor backend (`isolation: gvisor`, and `auto` where it runs): each response's
tests run in a gVisor sandbox of their own, whose kernel is gVisor's (the Sentry, a user-space
kernel in Go), not the host's.

    runsc = ensure_runsc(log)                     # setup.py: Debian's runsc, the OCI bundle
    bundle = Bundle.make(folder, python, plan)
    session = Session.start(runsc, bundle, cgroup) # one gVisor sandbox, its runner up (runner.py)
    result = session.run(program, stdin, limit_s, cap, limits, deadline)
    session.close()                               # the sandbox, and everything in it, gone

Why a sandbox per response and not per worker: inside one Sentry, its own counters and caches
(inode numbers, pipe ids, its dentry cache) are shared by everything it runs, so a worker's
sandbox kept for the whole run would give the copycat of a group its solver sibling's numbers
again, one level up. Per response, the tests of one program share a Sentry (they are one
program's); no two responses do. Starting one costs ~0.2-0.3 s here, mostly hidden: the worker
starts the next response's sandbox while the current one's tests run (Sandbox.session, run.py).

What a program reaches from there: the Sentry's system calls (no host system call: the ptrace
platform stops every one and the Sentry answers it), its own /proc, sysinfo and memory figures,
inode numbers, sockets (a loopback of its own: --network=none), locks and BPF (interpreted in the
Sentry, no JIT); the interpreter's files through the Gofer, read-only. What it shares with the host:
time (CPU contention, the clock), the host's page cache of the interpreter's files (cached ahead by
the worker, interpreter_files.warm), and the host lookups the Gofer makes for it (a missing name:
a negative dentry charged to the session's cgroup, emptied when it ends). The platform is ptrace:
this build (Debian's runsc 2022-12) has no systrap, and KVM did not start here (nested, under
Firecracker). docs/rewards.md has the whole threat model per backend.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from rollout.rewards.sandbox.cgroup import RunCgroup
from rollout.rewards.sandbox.gvisor.setup import Bundle, runsc_argv
from rollout.rewards.sandbox.reaping import adopting, children_of, reap, start_ticks

START_LIMIT_S = 20.0
"""Bound on a gVisor sandbox's start, to its runner's ready line (~0.2-0.3 s here, idle)."""
SENTRY_MB = 256
"""Memory of a session's cgroup beyond the program's memory_mb: the Sentry, the Gofer and the
ptrace platform's stub processes."""
SENTRY_TASKS = 256
"""Host tasks of a session beyond 4 per allowed program process (the Sentry's Go threads, the
Gofer's, the stubs)."""
REAP_WAIT_S = 0.5
_NAMES = itertools.count()


class Session:
    """One gVisor sandbox with its runner (module docstring); its processes in `cgroup`."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, state: Path, cgroup: RunCgroup | None) -> None:
        if proc.stdin is None or proc.stdout is None or proc.stderr is None:
            raise ValueError("a gVisor session needs runsc's stdin, stdout and stderr as pipes")
        self.proc, self.name, self.state, self.cgroup = proc, name, state, cgroup
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.started = start_ticks(proc.pid)
        self.up = False
        self.failed = ""

    @classmethod
    def start(cls, runsc: str, bundle: Bundle, state: Path, cgroup: RunCgroup | None,
              preexec: Callable[[], None], env: dict[str, str]) -> "Session":
        """Start it (it boots while the caller goes on; `wait_up` waits for its runner); `env`:
        runsc's own environment (never the program's: config.json sets that)."""
        name = f"gspo-{os.getpid()}-{next(_NAMES)}"
        proc = subprocess.Popen(runsc_argv(runsc, state) + ["run", f"--bundle={bundle.path}", name],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=preexec, start_new_session=True, cwd="/", env=env)
        session = cls(proc, name, state, cgroup)
        os.set_blocking(session.stdin.fileno(), False)
        return session

    def wait_up(self, until: float) -> bool:
        """Whether its runner said ready by `until` (time.monotonic()); else `failed` says why."""
        if self.up:
            return True
        line = _read_line(self.stdout.fileno(), min(until, time.monotonic() + START_LIMIT_S))
        if line == b"ready\n":
            self.up = True
            return True
        self.failed = f"gVisor's sandbox did not start ({line!r}): {self._stderr()}"
        return False

    def run(self, program: bytes, stdin: bytes, limit_s: float, cap: int, limits: dict[str, int],
            until: float) -> tuple[str, int | None, bytes, bytes] | None:
        """(status, returncode, stdout, stderr tail) of one program in the sandbox, or None when
        the sandbox did not answer by `until` (then it is closed: the caller says timeout)."""
        request = {"program": len(program), "stdin": len(stdin), "limit_s": limit_s, "cap": cap, "limits": limits}
        try:
            _write_all(self.stdin.fileno(), json.dumps(request).encode() + b"\n" + program + stdin, until)
            line = _read_line(self.stdout.fileno(), until)
            header = json.loads(line) if line.endswith(b"\n") else None
            if header is None:
                return None
            body = _read_exactly(self.stdout.fileno(), header["stdout"] + header["stderr"], until)
        except (OSError, ValueError):
            return None
        if body is None:
            return None
        return header["status"], header["returncode"], body[:header["stdout"]], body[header["stdout"]:]

    def kill(self) -> None:
        """SIGKILL runsc and, through its cgroup, the Sentry, the Gofer and the stubs (not waited for)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            try:
                (self.cgroup.dirs[0] / "cgroup.kill").write_text("1")  # v2 (5.14+); v1: close() kills each
            except OSError:
                pass

    def close(self) -> None:
        """Kill the sandbox (its runsc, Sentry, Gofer and stubs: the session's cgroup), wait for it,
        reap what runsc's death left to this process, empty and remove its cgroup, remove its state."""
        with adopting():  # the Sentry and the Gofer outlive runsc, killed first: they come here, not to PID 1
            tree = _descendants(self.proc.pid)  # before anything ends: a zombie leaves its cgroup's list
            self.kill()
            for stream in (self.stdin, self.stdout, self.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            seen = self.cgroup.remove() if self.cgroup is not None else set()  # the Sentry is a session of its own
            self.proc.wait()
            reap((seen | tree) - {self.proc.pid}, self.proc.pid, time.monotonic() + REAP_WAIT_S)
            _reap_strays(self.started)
        shutil.rmtree(self.state / self.name, ignore_errors=True)

    def _stderr(self) -> str:
        try:
            os.set_blocking(self.stderr.fileno(), False)
            text = (self.stderr.read() or b"").decode(errors="replace")
        except (OSError, ValueError):
            text = ""
        return " ".join(text.split())[-300:] or f"exit code {self.proc.poll()}"


def _reap_strays(since: int) -> None:
    """Reap the zombies of gVisor's processes (runsc re-executes itself: `exe`) that came to this
    process after `since` (clock ticks) while another session's end made it a subreaper: a Sentry
    that died under its program left its Gofer and stubs before its own session ended."""
    for pid in children_of(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                head, _, rest = f.read().rpartition(b")")
        except OSError:
            continue
        fields = rest.split()
        if head.endswith(b"(exe") and fields[0] == b"Z" and int(fields[19]) >= since:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        found = children_of(todo.pop())
        out.update(found)
        todo += found
    return out


def _read_line(fd: int, until: float) -> bytes:
    out = bytearray()
    while not out.endswith(b"\n"):
        left = until - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _read_exactly(fd: int, n: int, until: float) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        left = until - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, min(1 << 20, n - len(out)))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _write_all(fd: int, data: bytes, until: float) -> None:
    view = memoryview(data)
    while view:
        left = until - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise OSError("gVisor's sandbox took no input in time")
        try:
            view = view[os.write(fd, view[:1 << 16]):]
        except BlockingIOError:
            continue


class GvisorBackend:
    """A worker's gVisor sessions (module docstring): the one its current response's tests run in,
    and the next one, started ahead while they run."""

    def __init__(self, runsc: str, bundle: Bundle, state: Path, make_cgroup: Callable[[], RunCgroup | None],
                 preexec: Callable[[RunCgroup | None], Callable[[], None]], env: dict[str, str]) -> None:
        self.runsc, self.bundle, self.state, self.env = runsc, bundle, state, env
        self.make_cgroup, self.preexec = make_cgroup, preexec
        self.current: Session | None = None
        self.spare: Session | None = None
        self.in_session = False
        self.closing: list[threading.Thread] = []
        """Sessions ending in the background: a response's score does not wait for its sandbox's
        teardown (~0.2-0.5 s: the kill, the cgroup emptied, runsc's state removed)."""

    def _start(self) -> Session:
        cgroup = self.make_cgroup()
        try:
            return Session.start(self.runsc, self.bundle, self.state, cgroup, self.preexec(cgroup), self.env)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One response's tests in one gVisor sandbox; the next response's started meanwhile."""
        self.current, self.spare = self.spare or self._start(), None
        self.in_session = True
        try:
            self.spare = self._start()
            yield
        finally:
            self.in_session = False
            if self.current is not None:
                self._retire(self.current)

    def run(self, program: bytes, stdin: bytes, limit_s: float, cap: int, limits: dict[str, int],
            until: float) -> tuple[str, int | None, bytes, bytes]:
        """(status, returncode, stdout, stderr tail): the runner's status, or sandbox_error (the
        sandbox did not start), timeout (no answer by `until`), runtime_error (the sandbox died
        under the program: its memory, its processes)."""
        if self.current is None:
            self.current = self.spare or self._start()
            self.spare = None
        session = self.current
        if not session.wait_up(until):
            self._drop(session)
            return "sandbox_error", None, b"", session.failed.encode()
        answer = session.run(program, stdin, limit_s, cap, limits, until)
        if answer is None or not self.in_session:
            self._drop(session)
        if answer is not None:
            return answer
        if time.monotonic() >= until:
            return "timeout", None, b"", b""
        return "runtime_error", None, b"", b"the gVisor sandbox ended under the program"

    def _drop(self, session: Session) -> None:
        self._retire(session)

    def _retire(self, session: Session) -> None:
        """Close it in the background (killed there at once: nothing of a program runs on)."""
        self.closing = [t for t in self.closing if t.is_alive()]
        self.closing.append(threading.Thread(target=session.close, name="gvisor-close", daemon=True))
        self.closing[-1].start()
        if self.current is session:
            self.current = None

    def close(self) -> None:
        """End every session, the spare one too, and wait for those ending in the background."""
        for session in (self.current, self.spare):
            if session is not None:
                session.close()
        self.current = self.spare = None
        for thread in self.closing:
            thread.join()
        self.closing = []
