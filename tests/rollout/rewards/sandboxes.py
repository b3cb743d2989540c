"""The code sandbox tests' shared pieces: a probed Sandbox of a mode (skipped where the machine
cannot make one), and the processes a run left behind."""
from __future__ import annotations

from typing import Literal

import psutil
import pytest

from rollout.rewards.sandbox.run import SANDBOX_ENV, Sandbox, SandboxUnavailable
from rollout.rewards.settings import CodeSandboxSettings


def probed_sandbox(isolation: Literal["auto", "namespaces", "process"], **kw) -> Sandbox:
    sandbox = Sandbox(CodeSandboxSettings(isolation=isolation, **kw))
    try:
        sandbox.probe()
    except SandboxUnavailable as e:
        pytest.skip(f"no {isolation} sandbox on this machine: {e}")
    return sandbox


def leftovers(sandbox: Sandbox) -> list[int]:
    """Processes still running with this sandbox's tag in their environment."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(SANDBOX_ENV) == sandbox.tag:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out
