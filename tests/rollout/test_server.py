"""Server lifecycle: start failure shows the log tail, stop leaves no process, attach mode."""
from __future__ import annotations

import os
import time

import pytest

from rollout.server import ServerConfig, ServerGroup, ServerStartError, free_port, server_process


def test_cpu_launch_command_uses_stand_in_only_on_cpu(tmp_path):
    cpu = server_process(ServerConfig(model_path="/m", device="cpu"), tmp_path)
    assert "--device" in cpu.cmd and cpu.cmd[cpu.cmd.index("--device") + 1] == "cpu"
    assert cpu.env["SGLANG_USE_CPU_ENGINE"] == "1" and "cpu_stand_ins" in cpu.env["PYTHONPATH"]
    assert cpu.cmd[cpu.cmd.index("--dtype") + 1] == "float32" and "--sleep-on-idle" in cpu.cmd
    gpu = server_process(ServerConfig(model_path="/m", device="cuda", env={"PYTHONPATH": "/x"}), tmp_path)
    assert "cpu_stand_ins" not in gpu.env.get("PYTHONPATH", "") and "SGLANG_USE_CPU_ENGINE" not in gpu.env
    with pytest.raises(ValueError, match="device"):
        ServerConfig(model_path="/m", device="tpu").resolved_device()


@pytest.mark.slow
def test_start_failure_raises_with_log_tail(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"exited with code .* during startup; log .*last lines") as e:
        ServerGroup.launch(ServerConfig(model_path=str(tmp_path / "no-such-model"), log_dir=str(tmp_path),
                                        startup_timeout_s=240))
    assert "no-such-model" in str(e.value)  # the tail of SGLang's own log explains why
    assert time.monotonic() - t0 < 240


def test_attach_to_nothing_times_out_clearly():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerStartError, match=f"no healthy SGLang server at {url}"):
        ServerGroup.attach([url], health_timeout_s=1)


@pytest.mark.slow
def test_attach_and_clean_stop(qwen3_server):
    attached = ServerGroup.attach(qwen3_server.server_urls)
    attached.stop()  # attached servers are not ours: still running
    proc = qwen3_server.servers[0]
    assert proc.alive()
    # a server of our own: stop() ends the whole process group (scheduler, detokenizer too)
    from fixtures_servers import launch_tiny_server
    group = launch_tiny_server("qwen3", seed=2)
    pgid, logs = group.servers[0].proc.pid, group.temp_log_dir
    assert logs is not None and list(logs.glob("sglang-*.log"))  # no log_dir given: a temporary one
    group.stop()
    time.sleep(0.5)
    assert _live_members(pgid) == []
    assert not logs.exists()  # a clean stop removes the temporary logs


def test_temporary_logs_are_kept_when_the_run_fails(tmp_path):
    """Only a clean exit removes a temporary log folder; after an error it is what one reads."""
    logs = tmp_path / "logs"
    logs.mkdir()
    with pytest.raises(RuntimeError):
        with ServerGroup(["http://127.0.0.1:1"], temp_log_dir=logs):
            raise RuntimeError("the run failed")
    assert logs.is_dir()
    with ServerGroup(["http://127.0.0.1:1"], temp_log_dir=logs):
        pass
    assert not logs.exists()


def _live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (a container's PID 1 may never reap the
    orphaned, already-dead scheduler/detokenizer; zombies hold no memory or ports)."""
    live = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(int(entry))
    return live


def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    """A server's port must not be one an outgoing connection can take while the server starts
    (its own health poll included: a connect to a refused port from that same port connects to
    itself and the server then fails with "address already in use")."""
    import socket

    from rollout.ports import _ephemeral_range
    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(p < lo for p in ports), (lo, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
