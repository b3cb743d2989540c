"""The arguments of `gspo-megatron plan` (no torch import: the CLI builds its parser first)."""
from __future__ import annotations

import argparse
from pathlib import Path

from gspo_megatron.planner.sync_time import SYNC_CHANGED, SYNC_GBPS

GPU_KINDS = ("a100", "h100", "h200")  # plan.GPUS
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "qwen3_235b_a22b.yaml")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                   help="YAML run config: dtype, optimizer, token budget, recompute, rollout sizes "
                   f"(default {DEFAULT_CONFIG}: the paper's batch on H100 nodes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field (repeatable)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", choices=GPU_KINDS, default="h100", help="GPU kind: peak, links, memory")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GiB (default: the GPU kind's)")
    p.add_argument("--nodes", type=int, help="nodes (GPUs per node = gpus / nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8, or gpus / nodes)")
    p.add_argument("--model", help="a published model name (model_specs/hf/published.py), "
                   "tiny-qwen3-moe, or an HF config.json / model folder; default: the config's model.hf_path")
    p.add_argument("--tokens", type=int, help="tokens per train micro-batch (default: "
                   "train.max_tokens_per_micro_batch, else 16384)")
    p.add_argument("--step-tokens", type=int, help="tokens per optimizer step over all ranks (default: "
                   "prompts_per_step x group_size x max_new_tokens / mini_batches)")
    p.add_argument("--layout", help="fix some layout fields, e.g. tensor=4,pipeline=8")
    p.add_argument("--top", type=int, default=10, help="fitting layouts to print")
    p.add_argument("--sync-gbps", type=float, default=SYNC_GBPS, metavar="GB/S",
                   help=f"weight-sync bandwidth per sending GPU, and per server GPU, in GB/s (default "
                   f"{SYNC_GBPS:g}: one 400 Gb/s NIC per H100 at about half of line rate end to end)")
    p.add_argument("--server-gpus", type=int, metavar="N", help="server GPUs that ingest the weights "
                   "(default: --gpus, a colocated or equal-size rollout fleet)")
    p.add_argument("--sync-changed", type=float, default=SYNC_CHANGED, metavar="FRACTION",
                   help=f"fraction of the elements that change per step in the served dtype, for the delta "
                   f"sync (default {SYNC_CHANGED:g}; benchmarks/sync.py measures well below this at the "
                   "paper's learning rate 1e-6): put a run's measured sync/changed_fraction here")
    p.add_argument("--host-memory", help="host memory per node, for the optimizer offload's state "
                   "(default 2TB: an 8-GPU H100 node)")
    p.add_argument("--all", action="store_true", help="also print the layouts that do not fit, with why")
    p.add_argument("--check", action="store_true", help="run the chosen layout (--layout, else the "
                   "config's parallel section) for two steps and print predicted against measured")


# Counts that mean nothing at zero or below: (dest, flag). A default of None is the flag not given.
# (--server-gpus and the sync's numbers: command.sync_settings.)
POSITIVE = (("gpus", "--gpus"), ("nodes", "--nodes"), ("gpus_per_node", "--gpus-per-node"),
            ("tokens", "--tokens"), ("step_tokens", "--step-tokens"), ("top", "--top"))


def check_arguments(args: argparse.Namespace) -> None:
    """PlanError (one line, exit 2) for a count below 1 (argparse reads `-5` as an int, and a 0
    must not be taken for "not given"), and for GPUs that do not fill whole nodes."""
    from gspo_megatron.planner.plan import PlanError
    for dest, flag in POSITIVE:
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise PlanError(f"{flag} {value}: expected >= 1")
    if args.nodes is not None and args.gpus % args.nodes:
        raise PlanError(f"--nodes {args.nodes}: expected a divisor of --gpus {args.gpus}")
    per_node = args.gpus_per_node
    if per_node is not None and args.nodes is not None and args.nodes * per_node != args.gpus:
        raise PlanError(f"--nodes {args.nodes} x --gpus-per-node {per_node} = {args.nodes * per_node} "
                        f"GPUs: expected --gpus {args.gpus}")
    if per_node is not None and args.gpus > per_node and args.gpus % per_node:
        whole = args.gpus - args.gpus % per_node
        raise PlanError(f"--gpus {args.gpus}: expected a multiple of --gpus-per-node {per_node} (whole "
                        f"nodes, e.g. {whole} or {whole + per_node}), or at most {per_node} on one node")
