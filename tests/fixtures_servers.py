"""Real SGLang servers on CPU for the rollout tests (session-scoped: each costs ~25 s, ~2.3 GB).

Registered as a pytest plugin by tests/conftest.py so that every module shares one instance:
    qwen3_server  -> ServerGroup with one server on tiny_model_dir("qwen3", 0)
    moe_server    -> ServerGroup with one server on tiny_model_dir("qwen3_moe", 0)
Tests that change a server's weights must restore them (seed-0 weights) before returning.
"""
from __future__ import annotations

import pytest

from fixtures_models import tiny_model_dir


def launch_tiny_server(arch: str, seed: int = 0, num_servers: int = 1, **kw):
    from rollout.servers.launch import ServerConfig, ServerGroup
    return ServerGroup.launch(ServerConfig(model_path=str(tiny_model_dir(arch, seed)), device="cpu",
                                           startup_timeout_s=300, **kw), num_servers=num_servers)


@pytest.fixture(scope="session")
def qwen3_server():
    with launch_tiny_server("qwen3") as group:
        yield group


@pytest.fixture(scope="session")
def moe_server():
    with launch_tiny_server("qwen3_moe") as group:
        yield group
