"""SGLang server lifecycle: launch servers (and optionally sglang-router) as child processes, or
attach to servers already running elsewhere (cluster mode).

    from rollout.servers.launch import ServerConfig, ServerGroup
    with ServerGroup.launch(ServerConfig(model_path="/tmp/tiny"), num_servers=2, router=True) as g:
        print(g.server_urls, g.router_url)        # http://127.0.0.1:PORT ...
    group = ServerGroup.attach(["http://node1:30000", "http://node2:30000"])  # stop() is a no-op

Every child runs in its own process group (SGLang forks a scheduler and a detokenizer), logs to a
file, and is stopped with SIGTERM to the group, then SIGKILL after a grace period. Startup waits for
/health with a timeout; a child that dies meanwhile raises ServerStartError with the log's tail,
after one retry when its log shows a transient cause (TRANSIENT: the KV-cache memory check while
other processes took memory, a port taken by another process), said in one line.
On CPU (no CUDA) the child gets SGLang's CPU engine and the `sgl_kernel` stand-in on its PYTHONPATH
(rollout/cpu_stand_ins, docs/cpu.md); on GPU machines nothing is substituted.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import requests

from rollout.in_server.cpu_stand_ins import STAND_INS_DIR
from rollout.in_server.startup import STARTUP_DIR
from rollout.servers.managed_process import ManagedProcess, ServerStartError, transient_cause  # noqa: F401  (the API)
from rollout.servers.ports import free_port
from rollout.servers.memory import FLOOR, cpu_mem_fraction_static


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@dataclasses.dataclass
class ServerConfig:
    """How to launch one SGLang server (`python -m sglang.launch_server`)."""

    model_path: str
    """HF model directory (config.json, safetensors, tokenizer)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when torch sees a GPU). "cpu" uses the CPU engine + stand-in."""
    dtype: str | None = None
    """--dtype; None: float32 on CPU (exact log-prob parity with the trainer), SGLang's default on GPU."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None: a free port is picked at start."""
    tp_size: int = 1
    base_gpu_id: int | None = None
    max_total_tokens: int | None = 16384
    """KV-cache size in tokens; a batch that does not fit runs in waves."""
    mem_fraction_static: float | None = None
    """None: on CPU derived from the model's size, the KV cache (max_total_tokens) and the free
    memory (rollout/servers/memory.py); on GPU SGLang's default."""
    return_routed_experts: bool = False
    """--enable-return-routed-experts: the server can return every token's routed experts (MoE
    routing replay; ManagerConfig.return_routed_experts asks for them). MoE models only. The
    server then starts with the patch that keeps a retracted request's routes
    (rollout/in_server/startup), on CPU also the stand-in's, which lets its host buffer skip CUDA
    pinning."""
    extra_args: Sequence[str] = ()
    """More launch_server flags, passed through verbatim."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    log_dir: str | None = None
    """Where `sglang-PORT.log` goes; None: a temporary directory (kept after stop for post-mortems)."""
    role: str = "SGLang server"
    """How lines and errors name the server ("teacher server" for distillation's teacher)."""

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if cuda_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"ServerConfig.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        return self.device


def cpu_fraction(config: ServerConfig) -> float:
    """--mem-fraction-static on CPU: the config's, else derived (rollout/servers/memory.py). A
    model folder that cannot be read gets the floor: SGLang's own error then says what is wrong."""
    if config.mem_fraction_static is not None:
        return config.mem_fraction_static
    try:
        return cpu_mem_fraction_static(config.model_path, config.max_total_tokens, config.dtype)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return FLOOR


def server_process(config: ServerConfig, log_dir: Path) -> ManagedProcess:
    """The launch command and environment for one SGLang server (not started)."""
    device = config.resolved_device()
    port = config.port or free_port(config.host)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(config.model_path),
           "--host", config.host, "--port", str(port), "--device", device,
           "--tp-size", str(config.tp_size), "--skip-server-warmup"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **config.env}
    routes = config.return_routed_experts or "--enable-return-routed-experts" in config.extra_args
    # Python's start-up patches (sitecustomize): the routes of released requests kept on every
    # device (rollout/in_server/startup), the stand-ins on a CPU
    startup = ([str(STARTUP_DIR)] if routes else []) + ([str(STAND_INS_DIR)] if device == "cpu" else [])
    if startup:
        env["PYTHONPATH"] = os.pathsep.join(startup + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device == "cpu":
        cmd += ["--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled", "--dtype", config.dtype or "float32",
                "--mem-fraction-static", str(cpu_fraction(config)),
                # without it the idle scheduler busy-polls a core (docs/cpu.md)
                "--sleep-on-idle"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        if config.dtype:
            cmd += ["--dtype", config.dtype]
        if config.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(config.mem_fraction_static)]
        if config.base_gpu_id is not None:
            cmd += ["--base-gpu-id", str(config.base_gpu_id)]
    if config.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(config.max_total_tokens)]
    if config.return_routed_experts and "--enable-return-routed-experts" not in config.extra_args:
        cmd.append("--enable-return-routed-experts")
    if "--custom-weight-loader" not in config.extra_args:
        # the project's loader (weight deltas, checksums, read-back): chosen per request by
        # load_format, so registering it changes nothing else
        from rollout.in_server.weight_loader import LOADER
        cmd += ["--custom-weight-loader", LOADER]
    cmd += list(config.extra_args)
    return ManagedProcess(f"{config.role} (port {port})", cmd, env, f"http://{config.host}:{port}",
                          log_dir / f"sglang-{port}.log", "/health", config.startup_timeout_s,
                          config.stop_timeout_s)


def router_process(worker_urls: Sequence[str], log_dir: Path, host: str = "127.0.0.1",
                   port: int | None = None, policy: str = "round_robin",
                   startup_timeout_s: float = 120.0) -> ManagedProcess:
    """sglang-router in front of `worker_urls` (not started)."""
    port = port or free_port(host)
    # The router's Prometheus exporter binds port 29000 unless told otherwise, and panics when that
    # is taken (another router, another job): give it a free one too.
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
           "--policy", policy, "--worker-startup-check-interval", "1",
           "--prometheus-host", host, "--prometheus-port", str(free_port(host)),
           "--worker-urls", *worker_urls]
    return ManagedProcess(f"sglang-router (port {port})", cmd, dict(os.environ),
                          f"http://{host}:{port}", log_dir / f"router-{port}.log", "/health",
                          startup_timeout_s, ready_probe=_router_serves)


def _router_serves(url: str) -> bool:
    """The router answers /health before its workers are registered (then /generate is 503):
    ready means a 1-token generation goes through."""
    probe: dict[str, Any] = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}
    return requests.post(url + "/generate", json=probe, timeout=30).status_code == 200


class ServerGroup:
    """The SGLang servers (and optional router) a run talks to; a context manager that stops them.

    `launch` starts children and owns them; `attach` only records URLs (stop() leaves them alone).
    Logs go to config.log_dir, or else to a temporary folder that a clean stop removes (it is kept,
    and named in the error, when a server fails to start or the `with` block raises).
    """

    def __init__(self, server_urls: Sequence[str], router_url: str | None = None,
                 servers: Sequence[ManagedProcess] = (), router: ManagedProcess | None = None,
                 temp_log_dir: Path | None = None):
        if not server_urls:
            raise ValueError("a ServerGroup needs at least one server URL")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.servers = list(servers)
        self.router = router
        self.temp_log_dir = temp_log_dir

    @classmethod
    def attach(cls, server_urls: Sequence[str], router_url: str | None = None,
               health_timeout_s: float = 60.0, role: str = "SGLang server") -> "ServerGroup":
        """Use servers that someone else runs; checks each answers /health within the timeout
        (role: how the error names them)."""
        group = cls(server_urls, router_url)
        for url in group.server_urls + ([group.router_url] if group.router_url else []):
            deadline = time.monotonic() + health_timeout_s
            while True:
                try:
                    if requests.get(url + "/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(f"no healthy {role} at {url} within {health_timeout_s} s")
                time.sleep(0.5)
        return group

    @classmethod
    def launch(cls, config: ServerConfig, num_servers: int = 1, router: bool = False,
               router_policy: str = "round_robin",
               log: Callable[[str], None] = lambda line: print(f"[gspo] {line}", flush=True)) -> "ServerGroup":
        """Start `num_servers` servers from `config` in parallel (each on its own free port; on GPU
        server i gets base_gpu_id = i * tp_size unless set), wait until all are healthy (a start
        that failed for a transient cause is tried once more, said on `log`), then the router if
        asked. Any other failure stops everything already started and re-raises."""
        log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="gspo-sglang-logs-"))
        temp_log_dir = None if config.log_dir else log_dir
        procs: list[ManagedProcess] = []
        router_proc = None
        try:
            for i in range(num_servers):
                cfg = config
                if config.resolved_device() == "cuda" and config.base_gpu_id is None:
                    cfg = dataclasses.replace(config, base_gpu_id=i * config.tp_size)
                if num_servers > 1 and config.port is not None:
                    cfg = dataclasses.replace(cfg, port=config.port + i)
                procs.append(server_process(cfg, log_dir).start())
            for p in procs:
                p.wait_healthy_or_retry(log)
            if router:
                router_proc = router_process([p.url for p in procs], log_dir, config.host,
                                             policy=router_policy).start()
                router_proc.wait_healthy()
        except BaseException:
            for p in procs + ([router_proc] if router_proc else []):
                p.stop()
            raise
        return cls([p.url for p in procs], router_proc.url if router_proc else None, procs, router_proc,
                   temp_log_dir)

    def launched(self) -> dict[str, ManagedProcess]:
        """url -> the process of each server this group launched (none for attached ones): what
        rollout.servers.health.HealthMonitor restarts."""
        return {p.url: p for p in self.servers}

    def stop(self, keep_logs: bool = False) -> None:
        """Stop what this group launched (router first); attached servers are left running. Then
        remove the temporary log folder, if the group made one, unless keep_logs."""
        for p in ([self.router] if self.router else []) + self.servers:
            p.stop()
        if self.temp_log_dir is not None and not keep_logs:
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
            self.temp_log_dir = None

    def __enter__(self) -> "ServerGroup":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(keep_logs=exc_type is not None)

    def __repr__(self) -> str:
        return f"ServerGroup(servers={self.server_urls}, router={self.router_url})"



def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rollout.servers.launch --model-path DIR --host H --port P [SGLang flags...]`: one SGLang
    server in the foreground, with the same command line and environment the trainer's own servers
    get (on CPU: the CPU engine, float32, the sgl_kernel stand-in). The launch scripts
    (launch/server.sh) run it under srun; unknown flags go to sglang.launch_server verbatim.
    The process execs SGLang, so SIGTERM reaches SGLang directly."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m rollout.servers.launch", description=main.__doc__)
    parser.add_argument("--model-path", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    args, extra = parser.parse_known_args(argv)
    if not (Path(args.model_path) / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: no config.json (expected a Hugging Face model directory)")
    config = ServerConfig(model_path=args.model_path, device=args.device, dtype=args.dtype,
                          host=args.host, port=args.port, tp_size=args.tp_size,
                          max_total_tokens=args.max_total_tokens,
                          mem_fraction_static=args.mem_fraction_static, extra_args=extra)
    proc = server_process(config, Path(tempfile.gettempdir()))
    print(f"rollout.servers.launch: {' '.join(proc.cmd)}", file=sys.stderr, flush=True)
    os.execvpe(proc.cmd[0], proc.cmd, proc.env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
