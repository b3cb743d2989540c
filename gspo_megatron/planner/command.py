"""The `gspo-megatron plan` command: arguments, the run config's settings, the printed plan.

    gspo-megatron plan [CONFIG] --gpus N [--gpu h100] [--gpu-memory 80GiB] [--nodes M] [--host-memory 2TB]
                       [--model NAME|DIR] [--tokens N] [--layout tensor=4,pipeline=8] [--all]
                       [--sync-gbps 25] [--server-gpus N] [--sync-changed 0.05]
    gspo-megatron plan CONFIG --gpus 2 --model tiny-qwen3-moe --layout tensor=2 --check

The arguments are arguments.py's (imported by the CLI before torch is).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.planner.arguments import check_arguments
from gspo_megatron.planner.memory import GiB, MemorySettings
from gspo_megatron.planner.plan import GPUS, HOST_MEMORY, PlanError, load_model, parse_memory, plan, table
from gspo_megatron.planner.sync_time import SyncSettings, delta_bytes_per_element
from rollout.servers.ports import free_port


def _layout_fields(text: str | None) -> dict:
    out = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if key not in {"tensor", "pipeline", "virtual_pipeline", "expert", "expert_tensor", "context",
                       "first_stage_layers", "last_stage_layers"} or not value.isdigit():
            raise PlanError(f"--layout {text!r}: expected fields such as tensor=4,pipeline=8")
        out[key] = int(value)
    return out


def settings_from(cfg, tokens: int | None) -> MemorySettings:
    t, c = cfg.train, cfg.compute
    modules = tuple(c.recompute_modules) if c.recompute_modules else ("core_attn",)
    return MemorySettings(
        params_dtype=cfg.model.dtype,
        optimizer=t.optimizer, sgd_momentum=t.sgd_momentum,
        use_distributed_optimizer=t.use_distributed_optimizer, grad_reduce_in_fp32=t.grad_reduce_in_fp32,
        optimizer_offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
        max_tokens=tokens if tokens is not None else t.max_tokens_per_micro_batch or 16384, recompute=c.recompute,
        recompute_modules=modules, lora=cfg.lora)


def run(args: argparse.Namespace) -> int:
    from gspo_megatron.config import load_config
    check_arguments(args)
    gpu = GPUS[args.gpu]
    capacity = parse_memory(args.gpu_memory) if args.gpu_memory else gpu.memory
    sync = sync_settings(args)
    per_node = args.gpus_per_node or (args.gpus // args.nodes if args.nodes else min(8, args.gpus))
    cfg = load_config(args.config, args.overrides)
    sync = dataclasses.replace(sync, lora=cfg.lora)
    if args.model is not None:
        hf = load_model(args.model)
    else:  # the config's model: errors name the field and the file, not a flag the user never gave
        hf = load_model(cfg.model.hf_path, f"model.hf_path={cfg.model.hf_path!r} (of {args.config}; "
                        "no --model given)")
    s = settings_from(cfg, args.tokens)
    r = cfg.rollout
    step_tokens = args.step_tokens if args.step_tokens is not None else max(
        s.max_tokens, r.prompts_per_step * r.group_size * r.max_new_tokens // cfg.train.mini_batches)
    fixed = _layout_fields(args.layout)
    if args.check:
        return check(args, fixed or _config_layout(cfg))
    host = parse_memory(args.host_memory, "--host-memory") if args.host_memory else HOST_MEMORY

    def plan_with(settings):
        return plan(hf, args.gpus, gpu, capacity, per_node, settings, step_tokens,
                    mean_len=min(r.max_new_tokens, settings.max_tokens) / 2, fixed=fixed, sync=sync,
                    host_memory=host)
    rows, refused = plan_with(s)
    offered = None
    if rows and not any(x.fits for x in rows) and not s.optimizer_offload_fraction and s.optimizer == "adam":
        # Nothing fits with the optimizer on the GPUs: what fits with it on the host (how DeepSeek-V3
        # and Kimi-K2 train on 128 H100s), said as the settings that give it.
        offered = dataclasses.replace(s, use_distributed_optimizer=True, optimizer_offload_fraction=1.0)
        with_offload = plan_with(offered)[0]
        if any(x.fits for x in with_offload):
            rows, s = with_offload, offered
        else:
            offered = None
    if not rows:
        first = max(refused.values(), key=lambda v: v[0])[1] if refused else "none to try"
        raise PlanError(f"no valid layout of {args.gpus} GPUs{' with --layout ' + args.layout if fixed else ''}: {first}")
    fits = sum(r.fits for r in rows)
    print(f"{args.model or cfg.model.hf_path} on {args.gpus} x {args.gpu} ({capacity / GiB:.1f} GiB, "
          f"{per_node} per node): {cfg.model.dtype}, {s.optimizer}"
          f"{' (distributed)' if s.use_distributed_optimizer else ''}, recompute {s.recompute}, "
          f"{s.max_tokens} tokens per micro-batch, {step_tokens} tokens per step")
    if offered is not None:
        print("nothing fits with the optimizer's state on the GPUs; these fit with it on the host: "
              "set train.use_distributed_optimizer: true and train.optimizer_cpu_offload: true "
              "(GPU only; docs/performance.md)")
    if s.optimizer_offload_fraction:
        print(f"optimizer offload: {s.optimizer_offload_fraction:.0%} of each rank's optimizer state on the "
              f"host (of {host / GiB:.0f} GiB per node: --host-memory), stepped there; est. step s includes the copies and the "
              "host's Adam (gspo_megatron/planner/plan.py offload_time)")
    print(f"{len(rows)} valid layouts, {fits} fit; estimates: memory of the fullest pipeline stage, "
          "step time from FLOPs and communication (gspo_megatron/planner/plan.py)")
    total = rows[0].sync.total_bytes
    if cfg.lora.enabled:
        print(f"LoRA: {cfg.lora.describe()}; the base frozen (weights only), gradients and optimizer "
              "state for the adapters (gspo_megatron/planner/lora_params.py)")
        print(f"weight sync: the adapters only, {total / 1e9:.2f} GB in bf16 to each server from rank 0, "
              f"{sync.gbps:g} GB/s (sync s = delta s = rank0 s)\n")
    else:
        print(f"weight sync: {total / 1e9:.1f} GB in bf16, {sync.gbps:g} GB/s per sending GPU and per server "
              f"GPU, {sync.server_gpus} server GPUs; sync s: a full sync, every owner (senders = PP x EP) "
              f"sending its own; delta s: {sync.changed:g} of the elements changed "
              f"({delta_bytes_per_element(sync.changed):.3f} B each); rank0 s: a full sync through rank 0 "
              "(gspo_megatron/planner/sync_time.py)\n")
    if not fits:  # nothing fits: the nearest layouts and why, and a failing exit (a script must not go on)
        nearest = sorted(rows, key=lambda r: r.memory.total())[:args.top if args.all else 5]
        print(table(nearest, capacity, s, True, 0, per_node))
    else:
        print(table(rows, capacity, s, args.all, args.top, per_node))
        print("\n" + layout_settings(rows[0].layout, rows[0].name))
    if refused:
        top = sorted(refused.values(), key=lambda v: -v[0])[:5]
        print("\nrefused by the layout validation (count, an example): " +
              "; ".join(f"{n} x {example}" for n, example in top))
    if not fits:
        best = nearest[0]
        print(f"\ngspo-megatron plan: no layout fits {args.gpus} x {capacity / GiB:.1f} GiB; the nearest, "
              f"{best.name}, needs {best.memory.total() / GiB:.1f} GiB per GPU ({best.verdict}): more GPUs, "
              f"more memory per GPU, fewer tokens per micro-batch (--tokens) or recompute", file=sys.stderr)
        return 1
    return 0


def sync_settings(args: argparse.Namespace) -> SyncSettings:
    """The weight-sync flags, checked; the server GPUs default to the trainer's."""
    if not args.sync_gbps > 0:
        raise PlanError(f"--sync-gbps {args.sync_gbps:g}: expected GB/s > 0")
    if args.server_gpus is not None and args.server_gpus < 1:
        raise PlanError(f"--server-gpus {args.server_gpus}: expected >= 1")
    if not 0 <= args.sync_changed <= 1:
        raise PlanError(f"--sync-changed {args.sync_changed:g}: expected a fraction in [0, 1]")
    return SyncSettings(gbps=args.sync_gbps, server_gpus=args.server_gpus or args.gpus,
                        changed=args.sync_changed)


def layout_settings(layout: ParallelLayout, name: str) -> str:
    """The run config's `parallel:` section that gives `layout`, and the same as --set overrides:
    every field the planner chooses, nulls too (over a config that sets first_stage_layers, an
    even split must say null)."""
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name != "sequence_parallel"}
    text = {k: "null" if v is None else v for k, v in fields.items()}
    return "\n".join([f"the best layout, {name}, in the run config:", "parallel:",
                      *(f"  {k}: {v}" for k, v in text.items()),
                      "or on the command line: " + " ".join(f"--set parallel.{k}={v}" for k, v in text.items())])


def _config_layout(cfg) -> dict:
    import dataclasses
    return {f.name: getattr(cfg.parallel, f.name) for f in dataclasses.fields(cfg.parallel)
            if getattr(cfg.parallel, f.name) != f.default}


def check(args: argparse.Namespace, layout: dict) -> int:
    """Runs gspo_megatron/planner/check.py on --gpus ranks (torchrun; gloo on CPU)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, f"--nproc-per-node={args.gpus}", "--master-port", str(free_port()),
           "-m", "gspo_megatron.planner.check", args.config, "--layout",
           ",".join(f"{k}={v}" for k, v in layout.items()), "--gpu", args.gpu]
    for option in ("model", "tokens", "gpu_memory"):
        if getattr(args, option) is not None:
            cmd += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for o in args.overrides:
        cmd += ["--set", o]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode
