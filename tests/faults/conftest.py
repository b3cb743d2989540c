"""Fixtures of the fault-injection suite: a trained run to damage, a small disk."""
from __future__ import annotations

import pytest

from faults_common import tmpfs, train_args
from test_trainer_e2e import run_train, server_url  # noqa: F401  (server_url: the modules' fixture)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, moe_server):
    """One real run of one step with a checkpoint (step_00000001), copied by each test of every
    module (the run moves the server's weights: the requesting module's server_url restores them)."""
    run_dir = tmp_path_factory.mktemp("trained")
    proc = run_train(train_args(run_dir, moe_server.server_urls[0], **{"train.steps": 1}))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return run_dir


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one tiny-MoE checkpoint with its optimizer state, not for two."""
    with tmpfs(tmp_path / "disk", "3m") as mnt:
        yield mnt
