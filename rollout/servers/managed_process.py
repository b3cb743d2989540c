"""A child process the run owns: its own process group, a log file, a health URL, a clean stop,
and a restart that retries once when the start failed for a transient cause.

    proc = ManagedProcess("SGLang server (port 30000)", cmd, env, url, log_path).start()
    proc.wait_healthy_or_retry(log)     # ServerStartError with the log's tail otherwise
    proc.restart(log)                   # kill, start the same command line, wait again
    proc.stop()

rollout/servers/launch.py builds the command lines (SGLang servers, sglang-router) and groups them.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import requests

from gspo_errors import GspoError

# Start failures that another try may not meet, read from the server's log: (pattern, cause).
TRANSIENT = (
    (re.compile(r"leave no GPU memory for the KV cache|Not enough memory\. Please try to increase "
                r"--mem-fraction-static"), "SGLang's KV-cache memory check at start (other "
     "processes took memory while the model loaded)"),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"), "out of memory at start"),
    (re.compile(r"address already in use|Port is already in use"), "a port taken by another process"),
)
RETRY_PAUSE_S = 5.0
# SGLang's own words when one of its processes failed, after which it SIGKILLs its process tree
# (sglang 0.5 srt/managers/scheduler.py run_scheduler_process, tokenizer_manager.py
# running_phase_sigquit_handler, utils/common.py kill_process_tree): a death of its own, not a kill
# from outside (the OOM killer, a test, an operator), though both end with SIGKILL.
SELF_STOP = re.compile(r"Scheduler hit an exception|SIGQUIT received|Received sigquit from a child process")
# The last line of a Python traceback: the exception and its message.
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception)): ?(.*)$")


def _say(line: str) -> None:
    print(f"[gspo] {line}", flush=True)


class ServerStartError(GspoError, RuntimeError):
    """A server or router did not become healthy (died or timed out); the message has its log tail."""


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the launching thread's process dies, so a killed
    trainer or benchmark leaves no server behind (SGLang's scheduler and detokenizer do the same
    towards the server: sglang/srt/utils/common.py kill_itself_when_parent_died). Linux only;
    launch from a long-lived thread (the signal fires when the creating thread exits)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


class ManagedProcess:
    """A child process in its own process group, with a log file, a health URL and a clean stop."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], url: str, log_path: Path,
                 health_path: str = "/health", startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 30.0, ready_probe: Callable[[str], bool] | None = None):
        """ready_probe(url) -> True once the process serves (default: GET health_path is 200)."""
        self.name, self.cmd, self.env, self.url = name, cmd, env, url
        self.ready_probe = ready_probe or (
            lambda u: requests.get(u + health_path, timeout=5).status_code == 200)
        self.log_path, self.health_path = log_path, health_path
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log_offset = 0  # where this start's part of the (appended) log begins
        self._halted = False  # halt(): the run stops it; no retry starts it again

    def start(self) -> "ManagedProcess":
        if self._halted:
            raise ServerStartError(f"{self.name} at {self.url}: stopped by the run, not started again")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def log_of_this_start(self) -> str:
        """What the process logged since its last start (an earlier start's failure is not its)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def death_cause(self) -> str | None:
        """Why the process died, when it stopped on its own with a Python exception (SGLang's
        SELF_STOP words, or an exit code of its own): the traceback's last line, as
        "IndexError: index out of range in self"; None while it runs, or when it was killed from
        outside (its log of this start has no exception of its own)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        log = self.log_of_this_start()
        if self.proc.returncode < 0 and not SELF_STOP.search(log):
            return None
        last = None
        for line in log.splitlines():
            m = EXCEPTION_LINE.match(line.strip())
            if m:
                last = f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
        return re.sub(r"0x[0-9a-f]+", "0x...", last) if last else None

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise ServerStartError(f"{self.name} at {self.url} exited with code {code} during startup; "
                                       f"log {self.log_path}, last lines:\n{self.log_tail()}")
            try:
                if self.ready_probe(self.url):
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} at {self.url} not healthy after {timeout_s:.0f} s; "
                                       f"log {self.log_path}, last lines:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after stop_timeout_s; idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
                if sig == signal.SIGTERM:  # a stopped (stalled) server handles it only once continued
                    os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; sweep what it forked (scheduler, detokenizer) if any survived
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self.proc.wait(timeout=10)

    def wait_healthy_or_retry(self, log: Callable[[str], None] = _say) -> None:
        """wait_healthy; a start that failed for a transient cause (TRANSIENT, in its log) is
        killed and started once more, after RETRY_PAUSE_S, with a line saying why. A second
        failure raises ServerStartError, which says it was retried. A process SIGKILLed meanwhile
        (the run stopping it: HealthMonitor.close) is not started again."""
        try:
            self.wait_healthy()
            return
        except ServerStartError as e:
            killed = self.proc is not None and self.proc.returncode == -signal.SIGKILL
            cause = None if killed else transient_cause(self.log_of_this_start())
            if cause is None:
                raise
            log(f"{self.name} at {self.url} failed to start ({cause}): retrying once in "
                f"{RETRY_PAUSE_S:g} s; log {self.log_path}")
            first = str(e).splitlines()[0]
        self.kill()
        time.sleep(RETRY_PAUSE_S)
        self.start()
        try:
            self.wait_healthy()
        except ServerStartError as e:
            raise ServerStartError(f"{str(e).splitlines()[0]} (the second try; the first: {first})\n"
                                   + "\n".join(str(e).splitlines()[1:])) from None

    def restart(self, log: Callable[[str], None] = _say) -> None:
        """Kill what is left of the process (a stalled or dead server: SIGKILL reaches a stopped
        process too), start the same command line on the same port, wait until healthy (once more
        after a transient failure; raises ServerStartError otherwise). The health monitor calls it
        (rollout/servers/health.py)."""
        self.kill()
        self.start()
        self.wait_healthy_or_retry(log)

    def halt(self) -> None:
        """SIGKILL it and let nothing start it again (a stop under way: HealthMonitor.close)."""
        self._halted = True
        self.kill()

    def kill(self) -> None:
        """SIGKILL the group at once (fault-injection in tests; prefer stop())."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def transient_cause(log_text: str) -> str | None:
    """Why a server's start failed, when another try may succeed (TRANSIENT); else None."""
    return next((cause for pattern, cause in TRANSIENT if pattern.search(log_text)), None)
