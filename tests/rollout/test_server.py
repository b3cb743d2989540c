"""Server lifecycle: start failure shows the log tail, stop leaves no process, attach mode."""
from __future__ import annotations

import json
import os
import time

import pytest

from rollout.servers.launch import ServerConfig, ServerGroup, ServerStartError, free_port, server_process


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

    from rollout.servers.ports import _ephemeral_range
    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(p < lo for p in ports), (lo, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_the_cpu_memory_fraction_is_derived_from_the_kv_cache_the_weights_and_the_free_memory(tmp_path):
    """SGLang starts only when fraction x free memory covers the weights, the KV cache of
    max_total_tokens and what others take meanwhile (rollout/servers/memory.py): 0.05 does not
    when memory is short; the derived fraction does, and grows with the KV cache asked for."""
    from fixtures_models import tiny_model_dir
    from rollout.servers.memory import HEADROOM_BYTES, cpu_mem_fraction_static, kv_bytes_per_token, weight_elements
    model = tiny_model_dir("qwen3", 0)
    cfg = json.loads((model / "config.json").read_text())
    free = 8 << 30
    want = (weight_elements(model) * 4 + 16384 * kv_bytes_per_token(cfg, 4) + HEADROOM_BYTES) / free
    assert cpu_mem_fraction_static(model, 16384, free_bytes=free) == pytest.approx(want, abs=1e-4)
    assert 0.05 * free < HEADROOM_BYTES  # the constant would have failed with 4 GiB taken meanwhile
    assert cpu_mem_fraction_static(model, 1 << 20, free_bytes=free) > cpu_mem_fraction_static(model, 16384, free_bytes=free)
    assert cpu_mem_fraction_static(model, 16384, free_bytes=1 << 30) == 0.9  # at most the ceiling
    cmd = server_process(ServerConfig(model_path=str(model), device="cpu"), tmp_path).cmd
    assert 0.05 <= float(cmd[cmd.index("--mem-fraction-static") + 1]) <= 0.9
    given = server_process(ServerConfig(model_path=str(model), device="cpu", mem_fraction_static=0.3), tmp_path).cmd
    assert given[given.index("--mem-fraction-static") + 1] == "0.3"


@pytest.mark.slow
def test_a_start_that_fails_for_a_transient_cause_is_retried_once_and_serves(tmp_path):
    """A port held by another process while SGLang starts: it loads the model, cannot bind, and
    exits; the launch says why and retries once (the holder is gone by then), and the server
    serves."""
    import socket

    from fixtures_models import tiny_model_dir
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        holder.close()  # the other process lets go of the port before the second try

    t0 = time.monotonic()
    with ServerGroup.launch(ServerConfig(model_path=str(tiny_model_dir("qwen3", 0)), device="cpu", port=port,
                                         log_dir=str(tmp_path)), log=log) as group:
        from rollout.servers.client import SGLangClient
        assert SGLangClient(group.server_urls[0]).generate([1, 2, 3], {"max_new_tokens": 2})[0].output_ids
    assert len(lines) == 1 and lines[0].startswith(f"SGLang server (port {port}) at http://127.0.0.1:{port} "
                                                   "failed to start (a port taken by another process): "
                                                   "retrying once in 5 s"), lines
    print(f"two starts in {time.monotonic() - t0:.0f} s")
