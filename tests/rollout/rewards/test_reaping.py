"""The reward worker reaps what its runs' kills orphan (rollout/rewards/sandbox/reaping.py): a run
killed at its time or output limit left its first process a zombie under the nearest subreaper or
PID 1, never reaped where the trainer is a container's first process (2 of 3 looping responses);
so did a child that left the run's session and exited before the program."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.rewards.sandbox.reaping import PR_SET_CHILD_SUBREAPER, children_of

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from rollout.rewards.sandbox.run import Sandbox
    from rollout.rewards.settings import CodeSandboxSettings
    s = Sandbox(CodeSandboxSettings(isolation={isolation!r}, max_output_bytes=1 << 16))
    s.probe()
    statuses = [s.run("while True: pass", b"", 0.5).status for _ in range(3)]
    statuses.append(s.run("import os, time\\nif os.fork() == 0:\\n    time.sleep(60)\\nwhile True: print('x' * 1000)",
                          b"", 5.0).status)
    # a child that leaves the run's session and exits: a zombie outside its group when the program ends
    statuses.append(s.run("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
                          "        os.closerange(0, 3)\\n        time.sleep(60)\\n    os._exit(0)\\n"
                          "time.sleep(0.2)", b"", 5.0).status)
    print(" ".join(statuses))
""")


def _zombies_of(parent: int) -> list[int]:
    out = []
    for pid in children_of(parent):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_what_a_killed_run_orphans_is_reaped_by_its_worker(isolation):
    # this process stands for a trainer that is a container's first process: a subreaper that
    # never reaps what it adopts; the worker below it runs looping and flooding programs
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        worker = subprocess.run([sys.executable, "-c", WORKER.format(root=str(ROOT), isolation=isolation)],
                                capture_output=True, text=True, timeout=120)
        assert worker.returncode == 0, worker.stderr[-2000:]
        assert worker.stdout.split() == ["timeout"] * 3 + ["output_limit", "ok"]
        left = _zombies_of(os.getpid())
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in children_of(os.getpid()):  # what the old sandbox left with this stand-in
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    assert left == []
