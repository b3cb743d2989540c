"""Run an untrusted Python program on one input, bounded and isolated (for `reward: code`).

    sandbox = Sandbox(CodeSandboxSettings())        # probes what this machine allows, once
    result = sandbox.run(program_text, stdin=b"3 4\\n", time_limit_s=2.0)
    result.status, result.stdout                     # "ok" | "runtime_error" | "timeout" | "output_limit"

Each run is a fresh process tree; what it isolates depends on the backend and the machine
(docs/rewards.md has the threat model per backend, and tests/rollout/rewards/ a test per promise).
The adversary is the policy being trained: anything a program can reach that tells it the expected
output, or that stops the run, it will learn to use.

gvisor (auto where it runs: root, Debian's runsc): a response's tests in a gVisor sandbox of their
own, gVisor's kernel and not the host's (gvisor/); `with sandbox.session():` around them.

namespaces (and auto where gVisor does not run, said at start: the kernel is then the host's)
- fresh user, mount, PID, network, IPC, UTS and cgroup namespaces per run (util-linux `unshare`);
  as root, made as an unprivileged user of the worker's own (users.py, util-linux `setpriv`), so
  the program's "root" is that user outside, and no run shares per-user budgets with another
  worker's;
- a root built from an allow-list (interpreter_files.py, first_process.py): the interpreter, its
  import path and the shared libraries they load, read-only, five device nodes, a fresh /proc, a
  private /tmp and /dev/shm; nothing else of the host (no project, run folders, data, sockets,
  /sys, /home, /root, /var, /run, the rest of /usr); pivot_root, the old root detached;
- no network (a network namespace with only a down loopback), no SysV IPC or hostname shared with
  the host or another run, no nested user namespace (max_user_namespaces 0 inside, and the filter);
- no other process visible; when the run ends or is killed, the kernel kills every process of its
  PID namespace (nothing escapes by double-forking or setsid);
- every capability dropped, no_new_privs, a system-call filter (seccomp.py).
process (only by choice; auto never falls back to it)
- a process group of its own (killed whole), limits, a private folder (0700) as the working
  directory, as root a user of the reward worker's own (users.py: it cannot signal, trace or read
  the worker, nor enter a concurrent run's folder); Landlock where the kernel has it (reads of the
  namespaces mode's root and /proc only, writes beneath its folder only), else as root what its
  user left in the host's temp directories removed after the run (process_mode.py); the filter
  refuses SysV IPC, sockets (socketpair stays), and signals, tracing, limits, priorities and
  scheduling of any process but its own; the host's PID, IPC and UTS namespaces, and without
  Landlock its file system. Said once at start.
Both: per test, a cgroup (cgroup.py) bounds memory (tmpfs, shared memory and memfd
included), processes and CPU of the whole run where one can be made; else the filter refuses
memfd_create, SysV IPC and unix and netlink sockets, and the process and descriptor counts are
lowered to FALLBACK_PROCESSES and FALLBACK_FILES; the cgroup's memory is emptied when the run
ends (what the run brought into the page cache leaves with it). And RLIMIT_CPU, RLIMIT_AS (memory
per process), RLIMIT_FSIZE, RLIMIT_NPROC, no core files, no locked memory; a wall-clock limit;
stdout capped (the program is killed past it); stdin from the test, never the expected output; the
worker a subreaper while a run lives, which reaps what the run's kill orphans (reaping.py). It is
not a VM: the kernel is shared, and a kernel exploit is out of its scope.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Iterator

from gspo_errors import GspoError
from rollout.rewards.sandbox.cgroup import CgroupLayout, RunCgroup
from rollout.rewards.sandbox.gvisor.sessions import SENTRY_MB, SENTRY_TASKS, GvisorBackend
from rollout.rewards.sandbox.gvisor.setup import Bundle, GvisorUnavailable, ensure_runsc, worker_folder
from rollout.rewards.sandbox.interpreter_files import root_plan, warm
from rollout.rewards.sandbox.process_mode import (FOLDER_PREFIX, landlock_abi, remove_folder, remove_left_behind,
                                                  remove_stale_folders)
from rollout.rewards.sandbox.reaping import (adopted_since, adopting, children_of, in_child,
                                              kill_group, reap, start_ticks)
from rollout.rewards.sandbox.seccomp import SELF_PID, build_filter
from rollout.rewards.sandbox.start_line import start_line, userns_hint
from rollout.rewards.sandbox.streams import SET_UP_LIMIT_S, STDERR_TAIL, communicate
from rollout.rewards.sandbox.users import run_user
from rollout.rewards.settings import INTERPRETER_START_S, CodeSandboxSettings

INIT_SOURCE = (Path(__file__).parent / "first_process.py").read_text()
REAP_WAIT_S = 0.5
"""How long a run's end waits for the processes its kill orphaned to exit (they are SIGKILLed)."""
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
PREFERRED_PYTHON = "/usr/bin/python3"
"""The system's interpreter, preferred: it needs only the system's libraries."""


SET_UP_TRIES, SET_UP_BACKOFF_S = 3, 0.05
"""Starts of one run whose set-up failed (the program never ran, so trying again is safe), the
first retry after SET_UP_BACKOFF_S, each next one 4 times later: a host budget spent for a moment
by someone else (the BPF JIT's, which every run's filter takes from) is not a failed response."""


class SandboxUnavailable(GspoError, RuntimeError):
    """The sandbox cannot run here as configured (no namespaces where they are required, no
    interpreter the sandbox user can run); the message says why and what to set."""


class SandboxFailure(GspoError, RuntimeError):
    """The sandbox failed to start a run, SET_UP_TRIES times: the machine's failure, not the
    response's. Scored with status "sandbox" (scoring.py): counted and said, never a reward error."""

    score_status = "sandbox"


@dataclasses.dataclass
class RunResult:
    status: str
    """ok (exit 0), runtime_error (non-zero exit, killed by a signal), timeout (wall or CPU limit,
    or the caller's deadline), output_limit (stdout past max_output_bytes), sandbox_error (ours)."""
    stdout: bytes
    stderr_tail: bytes
    returncode: int | None
    seconds: float


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
        self.syscall_filter: bytes | None = None
        self.uid: int | None = None
        """The runs' user outside their namespaces (root: this worker's own), None: the worker's."""
        self.whole_system = False
        """The system's directories bound whole: the loader could not list the libraries."""
        self._unreaped: set[int] = set()
        """Processes of earlier runs still exiting when their run ended: reaped by a later run."""
        self.landlock = 0
        """process mode: the Landlock ABI that confines the runs' files, 0: none."""
        self.set_up_failures = 0
        """Runs whose set-up failed and were started again (SET_UP_TRIES)."""
        self.gvisor: GvisorBackend | None = None
        self.fallback = ""
        """auto where gVisor does not run: why (said in the start-up line of the namespaces mode)."""

    # --- what this machine allows --------------------------------------------------------------
    def _prefix(self, mode: str) -> list[str]:
        if mode != "namespaces":
            return []
        # setpriv's uid change clears the parent-death signal: --pdeathsig sets it again
        drop = (["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--pdeathsig=KILL"]
                if self.uid is not None else [])
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
        if wanted in ("auto", "gvisor"):
            why = self._probe_gvisor()
            if why is None:
                return self.note
            if wanted == "gvisor":
                raise SandboxUnavailable(f"rollout.reward_args.isolation='gvisor': {why}; set "
                                         "rollout.reward_args.isolation: namespaces for the shared kernel's sandbox")
            self.fallback = why
        mode = "process" if wanted == "process" else "namespaces"
        self.cgroups = CgroupLayout.find()
        self.syscall_filter = build_filter(memory_unbounded=self.cgroups is None, shared_host=mode == "process")
        self.uid = run_user()
        if mode == "process":
            self.landlock = landlock_abi()
            if self.uid is not None:
                remove_stale_folders(time.monotonic() + SET_UP_LIMIT_S)
        reasons = []
        for python in self._candidates():
            self.mode, self.python = mode, python
            self.root, self.whole_system = root_plan(python)
            # what a run may read, and what the set-up reads (setpriv, unshare, the locale), cached
            # and charged to this worker: a run's cgroup is emptied at its end, and would take
            # with it, for every run to read again, the pages it was first to read
            warm(self.root)
            self._run_once("print(6 * 7)", b"", 10.0, bounded=False)
            for _ in range(PROBE_TRIES):
                r = self._run_once("print(6 * 7)", b"", 10.0)
                if r.status == "ok" and r.stdout.strip() == b"42":
                    self.note = self._describe()
                    return self.note
            reasons.append(f"{python}: {r.status} {_one_line(r.stderr_tail.decode(errors='replace'))}")
        self.mode = self.python = None
        if mode == "process":
            raise SandboxUnavailable("rollout.reward_args.isolation='process': no interpreter runs here: "
                                     + "; ".join(reasons))
        raise SandboxUnavailable(
            f"rollout.reward_args.isolation={wanted!r}: the sandbox's namespaces cannot be made here "
            f"({'; '.join(reasons)}){userns_hint()}; set rollout.reward_args.isolation: process to run "
            "programs with process isolation only (weaker: no file-system, network or IPC isolation)")

    def _probe_gvisor(self) -> str | None:
        """Settle the gVisor backend (gvisor/) and run the probe's program in it; None when it
        runs, else why not (one line)."""
        if os.geteuid() != 0:
            return "gVisor's runsc needs a root worker here"
        try:
            runsc = ensure_runsc(lambda line: print(f"[gspo] {line}", file=sys.stderr, flush=True))
        except GvisorUnavailable as e:
            return str(e)
        self.cgroups = CgroupLayout.find()
        self.python = self._candidates()[0]
        self.root, self.whole_system = root_plan(self.python)
        warm(self.root)  # read by the Gofer for the Sentry: cached, charged to this worker
        folder = worker_folder()
        s = self.settings
        self.gvisor = GvisorBackend(
            runsc, Bundle.make(folder / "bundle", self.python, self.root, TMP_MB, SHM_MB), folder / "state",
            lambda: (self.cgroups.create((s.memory_mb + SENTRY_MB) << 20, 4 * s.max_processes + SENTRY_TASKS)
                     if self.cgroups is not None else None), in_child,
            {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", SANDBOX_ENV: self.tag})
        weakref.finalize(self, self.gvisor.close)  # the spare sandbox, started ahead, with this one
        self.mode = "gvisor"
        for _ in range(PROBE_TRIES):
            r = self._run_once("print(6 * 7)", b"", 10.0)
            if r.status == "ok" and r.stdout.strip() == b"42":
                self.note = self._describe()
                return None
        self.gvisor.close()
        self.mode = self.python = self.gvisor = None
        return f"gVisor's sandbox does not run a program here: {r.status} {_one_line(r.stderr_tail.decode(errors='replace'))}"

    def close(self) -> None:
        """End what outlives a run: gVisor's spare sandbox, started ahead for the next response (it
        holds no program; it is also ended with this object, and dies with the worker)."""
        if self.gvisor is not None:
            self.gvisor.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One response's runs (gVisor: in one sandbox of their own; the other modes: each run is)."""
        self.probe()
        with self.gvisor.session() if self.gvisor is not None else contextlib.nullcontext():
            yield

    def _describe(self) -> str:
        return start_line(self, FALLBACK_PROCESSES)

    # --- one run -------------------------------------------------------------------------------
    def run(self, program: str, stdin: bytes, time_limit_s: float | None = None,
            deadline: float | None = None) -> RunResult:
        """The program on one input, within the limits (module docstring), and over by `deadline`
        (time.monotonic()) whatever the limit, set-up included: then its status is "timeout"."""
        self.probe()
        limit = time_limit_s or self.settings.time_limit_s
        for attempt in range(SET_UP_TRIES):
            result = self._run_once(program, stdin, limit, deadline)
            left = (deadline or math.inf) - time.monotonic()
            if result.status != "sandbox_error" or attempt == SET_UP_TRIES - 1 or left <= 0:
                return result
            self.set_up_failures += 1
            time.sleep(min(SET_UP_BACKOFF_S * 4 ** attempt, left))
        return result

    def _processes(self) -> int:
        s = self.settings
        return s.max_processes if self.cgroups is not None else min(s.max_processes, FALLBACK_PROCESSES)

    def _limits(self, time_limit_s: float) -> dict[str, int]:
        s = self.settings
        # a backstop past the wall limit, which decides "timeout" (CPU counts per process)
        cpu = math.ceil(time_limit_s + INTERPRETER_START_S) + 1
        # no locked memory: a page another run mlocks could not be evicted with its run's cgroup
        return {"RLIMIT_CPU": cpu, "RLIMIT_AS": s.memory_mb << 20, "RLIMIT_FSIZE": s.max_file_mb << 20,
                "RLIMIT_NPROC": self._processes(), "RLIMIT_CORE": 0, "RLIMIT_MEMLOCK": 0,
                "RLIMIT_NOFILE": FILES if self.cgroups is not None else FALLBACK_FILES, "RLIMIT_MSGQUEUE": 0}

    def _run_once(self, program: str, stdin: bytes, time_limit_s: float,
                  deadline: float | None = None, bounded: bool = True) -> RunResult:
        t0 = time.monotonic()
        hard = min(deadline or math.inf, t0 + SET_UP_LIMIT_S + time_limit_s + INTERPRETER_START_S)
        if self.gvisor is not None:
            # gVisor refuses RLIMIT_MSGQUEUE (its POSIX queues are its own, in its memory)
            limits = {k: v for k, v in self._limits(time_limit_s).items() if k != "RLIMIT_MSGQUEUE"}
            status, code, out, err = self.gvisor.run(program.encode(errors="surrogatepass"), stdin,
                                                     time_limit_s + INTERPRETER_START_S, self.settings.max_output_bytes,
                                                     limits, hard)
            return RunResult(status, out, err[-STDERR_TAIL:], code, time.monotonic() - t0)
        # the whole run in one cgroup, the sandbox's own unshare process included (+1)
        cgroup = (self.cgroups.create(self.settings.memory_mb << 20, self.settings.max_processes + 1)
                  if self.cgroups is not None and bounded else None)
        program_fd = os.memfd_create("program")
        os.write(program_fd, program.encode(errors="surrogatepass"))  # a lone surrogate: a SyntaxError, not ours
        os.lseek(program_fd, 0, os.SEEK_SET)
        status_r, status_w = os.pipe()
        config = {"mode": self.mode, "program_fd": program_fd, "status_fd": status_w, "python": self.python,
                  "limits": self._limits(time_limit_s), "root": self.root, "tmp_mb": TMP_MB, "shm_mb": SHM_MB,
                  "seccomp": self.syscall_filter.hex() if self.syscall_filter else None, "self_pid": SELF_PID,
                  "uid": self.uid, "landlock": self.landlock}
        if self.mode is None or self.python is None:
            raise RuntimeError("the sandbox is closed (or was never set up): no mode, no interpreter")
        argv = self._prefix(self.mode) + [self.python, "-I", "-S", "-c", INIT_SOURCE, json.dumps(config)]
        with adopting():  # what the run's kill orphans comes to this process, which reaps it
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(program_fd, status_w), start_new_session=True,
                                        preexec_fn=in_child(cgroup),
                                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", SANDBOX_ENV: self.tag})
            except BaseException:
                os.close(status_r)
                if cgroup is not None:
                    cgroup.remove()
                raise
            finally:
                os.close(program_fd)
                os.close(status_w)
            status, started = "", start_ticks(proc.pid)
            try:
                stdout, stderr, status, overflow, timed_out = communicate(
                    proc, stdin, status_r, time_limit_s + INTERPRETER_START_S, hard, self.settings.max_output_bytes)
            finally:
                os.close(status_r)
                self._end(proc, cgroup, started, status, deadline or math.inf)
        seconds = time.monotonic() - t0
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

    def _end(self, proc: subprocess.Popen, cgroup: RunCgroup | None, started: int, status: str,
             until: float) -> None:
        """Kill the run whole, remove its files (process mode), empty and remove its cgroup (its
        written files gone first: reclaim waits on dirty pages), and reap what the kill orphaned."""
        seen = set(self._unreaped)
        if cgroup is None and proc.poll() is None:
            seen.update(children_of(proc.pid))  # namespaces: its first process, which no cgroup lists
        kill_group(proc)
        if cgroup is not None:
            seen |= cgroup.kill()  # and with it whatever escaped the process group (process mode)
            if cgroup.lingering():  # zombies it lists no more: left to this process outside its group
                seen.update(adopted_since(started))
        if self.mode == "process":
            self._clean_up(status[3:].strip() if status.startswith("ok ") else "", until)
        if cgroup is not None:
            cgroup.release()
        seen.discard(proc.pid)
        self._unreaped = reap(seen, proc.pid, time.monotonic() + REAP_WAIT_S)

    def _clean_up(self, folder: str, until: float) -> None:
        """Process mode, after the run: its folder, and as root without Landlock what its user left in
        the host's temp directories, removed within the caller's deadline (process_mode.py)."""
        if folder.startswith(f"/tmp/{FOLDER_PREFIX}"):
            remove_folder(folder, until)
        if self.uid is not None and not self.landlock:
            remove_left_behind(self.uid, until, keep=folder)
