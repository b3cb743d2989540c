"""Module-scoped sandboxes for the code sandbox tests (sandboxes.py)."""
from __future__ import annotations

import pytest

from sandboxes import probed_sandbox


@pytest.fixture(scope="module")
def ns():
    return probed_sandbox("namespaces", max_output_bytes=1 << 20)


@pytest.fixture(scope="module")
def proc():
    return probed_sandbox("process", max_output_bytes=1 << 20)


@pytest.fixture(scope="module")
def small():
    """256 MiB per test, in a cgroup (skipped where none can be made)."""
    sandbox = probed_sandbox("namespaces", memory_mb=256)
    if sandbox.cgroups is None:
        pytest.skip("no cgroup can be made here (the fallback has its own test)")
    return sandbox
