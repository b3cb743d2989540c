"""The SGLang servers rank 0 works with: the policy's (attached by URL, or launched here) and, for
on-policy distillation, the teacher's.

    servers = start_policy_servers(cfg, log_dir)    # rollout.server_urls, else rollout.num_servers
    teachers = start_teachers(cfg, log_dir)         # None without distill.teacher
"""
from __future__ import annotations

import time

from gspo_megatron.config import ConfigError, RunConfig
from rollout.servers.launch import ServerConfig, ServerGroup


def wants_engine_routing(cfg: RunConfig) -> bool:
    """Ask SGLang for the routed experts of every token: rollout.return_routed_experts, or the
    moe: section needs them (replay, engine_routing). Attached servers must have been started with
    --enable-return-routed-experts (the first request says so otherwise)."""
    return bool(cfg.rollout.return_routed_experts or cfg.moe.replay or cfg.moe.engine_routing)


def start_policy_servers(cfg: RunConfig, log_dir: str | None) -> ServerGroup:
    """Attach to rollout.server_urls, or launch rollout.num_servers servers of model.hf_path."""
    r = cfg.rollout
    if r.server_urls:
        group = ServerGroup.attach(r.server_urls, r.router_url, health_timeout_s=r.server_startup_timeout_s)
        print(f"[gspo] SGLang: attached to {', '.join(group.server_urls)}", flush=True)
    else:
        extra = list(r.server_extra_args)
        server = ServerConfig(model_path=cfg.model.hf_path, extra_args=extra,
                              return_routed_experts=wants_engine_routing(cfg),
                              max_total_tokens=r.server_max_total_tokens,
                              startup_timeout_s=r.server_startup_timeout_s, log_dir=log_dir)
        if cfg.lora.enabled:  # the servers hold the run's adapter (lora/serving.py)
            from gspo_megatron.lora.serving import server_args
            extra += server_args(cfg.lora, cuda=server.resolved_device() == "cuda")
        if r.seed is not None:
            if server.resolved_device() == "cpu":
                raise ConfigError(
                    f"rollout.seed={r.seed}: seeded sampling needs SGLang's deterministic "
                    f"inference, which SGLang refuses with the CPU attention backend "
                    f"(torch_native); use rollout.seed=null (rollout.top_k=1 for greedy)")
            if "--enable-deterministic-inference" not in extra:
                extra.append("--enable-deterministic-inference")  # honours sampling_seed
        where = f"logs in {log_dir}" if log_dir else "logs in a temporary folder"
        print(f"[gspo] SGLang: starting {r.num_servers} server(s) for {cfg.model.hf_path} on "
              f"{server.resolved_device()} ({where}; ~30 s on a CPU)", flush=True)
        t0 = time.monotonic()
        group = ServerGroup.launch(server, num_servers=r.num_servers)
        print(f"[gspo] SGLang: ready in {time.monotonic() - t0:.0f} s at {', '.join(group.server_urls)}",
              flush=True)
    return group


def start_teachers(cfg: RunConfig, log_dir: str | None) -> ServerGroup | None:
    """On-policy distillation's teacher servers: attached (distill.teacher_server_urls) or started
    here, like the rollout servers (their lines and errors say "teacher server"); None without
    distill.teacher."""
    d, r = cfg.distill, cfg.rollout
    if not d.teacher:
        return None
    if d.teacher_server_urls:
        group = ServerGroup.attach(d.teacher_server_urls, health_timeout_s=r.server_startup_timeout_s,
                                   role="teacher server")
        print(f"[gspo] teacher: {d.teacher} at {', '.join(group.server_urls)} (attached)", flush=True)
        return group
    config = ServerConfig(model_path=d.teacher, extra_args=list(d.teacher_server_extra_args),
                          max_total_tokens=r.server_max_total_tokens,
                          startup_timeout_s=r.server_startup_timeout_s, log_dir=log_dir,
                          role="teacher server")
    print(f"[gspo] teacher: starting {d.teacher_num_servers} SGLang server(s) for {d.teacher}", flush=True)
    group = ServerGroup.launch(config, num_servers=d.teacher_num_servers)
    print(f"[gspo] teacher: ready at {', '.join(group.server_urls)}", flush=True)
    return group
