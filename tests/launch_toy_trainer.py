"""A small real torch.distributed program with the trainer's command line, for the launch tests.

    GSPO_TRAIN_CMD="python tests/launch_toy_trainer.py train" launch/slurm/submit.sh ... CONFIG.yaml \
        --set toy.steps=6 --set toy.step_seconds=1

It stands in for `gspo-megatron train` until the trainer exists, with the same contract: CONFIG.yaml,
`--set key=value` overrides, torch.distributed env:// variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) as torchrun or launch/rank.sh set them, `checkpoint.dir` with a
`latest` pointer it resumes from, and `rollout.server_urls` it must reach.

Each step all-reduces (rank + 1) * step over every rank (gloo on CPU, NCCL on GPU) and rank 0 then
commits a checkpoint atomically: step_NNNNNN.json (written to a temporary file, fsynced, renamed),
then `latest` (same way). The checkpoint carries the whole history: one entry per committed step
with its all-reduced value, the hosts of all ranks and SLURM_RESTART_COUNT. A run interrupted at any
point resumes after the last committed step, so the final history has every step exactly once.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        out[key] = yaml.safe_load(value)
    return out


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_latest(ckpt_dir: Path) -> dict:
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return {"step": 0, "history": []}
    return json.loads((ckpt_dir / latest.read_text().strip()).read_text())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["train"])
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text()) or {}
    sets = parse_overrides(args.overrides)
    steps = int(sets.get("toy.steps", config.get("toy", {}).get("steps", 4)))
    step_seconds = float(sets.get("toy.step_seconds", config.get("toy", {}).get("step_seconds", 0.0)))
    fail_at = sets.get("toy.fail_at_step")
    ckpt_dir = Path(sets["checkpoint.dir"])
    server_urls = sets.get("rollout.server_urls") or []

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    hosts: list[str] = [""] * world
    me = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    dist.all_gather_object(hosts, me)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    print(f"rank {rank}/{world} on {me} local_rank {os.environ['LOCAL_RANK']} restart {restart} "
          f"servers {server_urls}", flush=True)

    if rank == 0:
        for url in server_urls:  # the launcher passes healthy servers: reach each one
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                assert r.status == 200, (url, r.status)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = load_latest(ckpt_dir) if rank == 0 else None
    box = [state]
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    assert state is not None  # rank 0's, on every rank
    if rank == 0:
        print(f"resuming after step {state['step']}" if state["step"] else "starting fresh", flush=True)

    for step in range(state["step"] + 1, steps + 1):
        if fail_at is not None and step == int(fail_at):
            raise SystemExit(f"toy trainer: failing at step {step} as asked (toy.fail_at_step)")
        value = torch.tensor([float((rank + 1) * step)], device=device)
        dist.all_reduce(value)
        time.sleep(step_seconds)
        dist.barrier()
        if rank == 0:
            state = {"step": step, "history": state["history"] + [
                {"step": step, "value": value.item(), "hosts": hosts, "restart": restart,
                 "world_size": world, "servers": server_urls}]}
            name = f"step_{step:06d}.json"
            write_atomic(ckpt_dir / name, json.dumps(state))
            write_atomic(ckpt_dir / "latest", name)
            print(f"step {step} value {value.item()} committed", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
