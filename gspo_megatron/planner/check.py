"""`gspo-megatron plan ... --check`: run one layout for two steps and print predicted against
measured per rank (started by command.check under torchrun; gloo on CPU, NCCL on CUDA).

Measured: on CUDA torch.cuda.max_memory_allocated() over the second step (the whole rank's peak:
weights, gradients, optimizer state, activations, log-probs) and the step time; on CPU the bytes
of the parameters, DDP's gradient buffers and the optimizer state (activations are not measurable
per rank on CPU) and the step time (no prediction: the estimate is a GPU's).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from gspo_megatron.actor import Actor
    from gspo_megatron.config.schema import RunConfig
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import MemorySettings


def _batch(rows: int, length: int, vocab: int, seed: int):
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length)[None]
    lengths = torch.full((rows,), length)
    return TrainBatch(tokens=torch.randint(0, vocab, (rows, length), generator=g), lengths=lengths,
                      loss_mask=(t >= min(8, length // 2)) & (t < lengths[:, None]),
                      advantages=torch.randn(rows, generator=g))


def measured_static(actor) -> tuple[int, int, int]:
    """(weights, gradient buffers, optimizer state incl. fp32 main copies of 16-bit weights)."""
    weights = sum(p.numel() * p.element_size() for p in actor._local_params())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                for c in actor.chunks for b in c.buffers + c.expert_parallel_buffers)
    opt, half = 0, actor.spec.config.params_dtype != torch.float32
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in sub.optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())
        if half:
            opt += sum(p.numel() * 4 for g in sub.optimizer.param_groups for p in g["params"])
    return weights, grads, opt


def build_actor(cfg: RunConfig, hf: dict, layout: ParallelLayout, s: MemorySettings, length: int) -> Actor:
    """The actor the check measures: the run config's optimizer and compute settings (the
    prediction's recompute and recompute_modules come from the same `compute:` section,
    command.settings_from), micro-batches of `length`-token rows within the token budget."""
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import MicroBatchSettings
    opt = OptimizerSettings(**{k: getattr(cfg.train, k) for k in (
        "optimizer", "lr", "use_distributed_optimizer", "grad_reduce_in_fp32", "sgd_momentum")})
    return Actor(hf, layout, optimizer=opt, loss=LossSettings(name="gspo"), params_dtype=getattr(torch, s.params_dtype),
                 compute=cfg.compute,
                 batching=MicroBatchSettings(micro_batch_size=max(1, s.max_tokens // length),
                                             max_tokens_per_micro_batch=s.max_tokens))


def main() -> None:
    from gspo_megatron.config import load_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.process_groups import destroy_process_groups
    from gspo_megatron.planner.command import _layout_fields, settings_from
    from gspo_megatron.planner.memory import GiB, stage_memory
    from gspo_megatron.planner.plan import GPUS, load_model, step_time
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--layout", default="")
    p.add_argument("--model")
    p.add_argument("--tokens", type=int)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--gpu-memory")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    quiet_expected_warnings()
    cfg = load_config(args.config, args.overrides)
    hf = load_model(args.model or cfg.model.hf_path)
    s = settings_from(cfg, args.tokens)
    layout = ParallelLayout(**_layout_fields(args.layout))
    cuda = torch.cuda.is_available()
    world = int(os.environ["WORLD_SIZE"])
    length = min(s.max_tokens, 2048 if cuda else 64)
    rows = 2 * max(1, s.max_tokens // length)  # two micro-batches of the budget per DP rank
    with build_actor(cfg, hf, layout, s, length) as actor:
        from megatron.core import parallel_state as ps
        dp = ps.get_data_parallel_world_size()
        seconds = 0.0
        for step in range(2):
            shard = actor.shard(_batch(rows * dp, length, hf["vocab_size"], step))
            shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            actor.train_step(shard)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        stage = ps.get_pipeline_model_parallel_rank()
        settings = dataclasses.replace(s, num_microbatches=2)
        predicted = stage_memory(actor.spec, layout, world, settings, stage)
        mine = dict(rank=dist.get_rank(), stage=stage, measured=measured_static(actor), predicted=predicted,
                    peak=torch.cuda.max_memory_allocated() if cuda else None, seconds=seconds)
        est = step_time(actor.spec, layout, world, settings, GPUS[args.gpu], 8, rows * dp * length,
                        length / 2, predicted) if cuda else None
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(f"{layout.describe(world)}: {rows} rows x {length} tokens per DP rank, budget {s.max_tokens}, "
              f"{cfg.model.dtype}; predicted / measured")
        print("| rank | stage | weights MiB | gradients MiB | optimizer MiB | peak GiB | step s |")
        print("|---|---|---|---|---|---|---|")
        for r in everyone:
            w, g, o = r["measured"]
            pm = r["predicted"]
            mib = lambda a, b: f"{a / 2**20:.2f} / {b / 2**20:.2f}"  # noqa: E731
            peak = (f"{pm.total() / GiB:.2f} / {r['peak'] / GiB:.2f}" if r["peak"] is not None
                    else "- (CPU)")
            took = f"{est:.3f} / {r['seconds']:.3f}" if est is not None else f"- / {r['seconds']:.3f}"
            print(f"| {r['rank']} | {r['stage']} | {mib(pm.weights, w)} | {mib(pm.gradients, g)} | "
                  f"{mib(pm.optimizer, o)} | {peak} | {took} |")
    # Leave the groups together: a rank that exits while gloo's threads still serve another rank
    # aborts with "terminate called without an active exception" (SIGABRT; CI saw it on rank 1
    # after the table was printed). Only on success: after an error a barrier would wait for the
    # group's timeout, where torchrun ends the other ranks at once.
    dist.barrier()
    destroy_process_groups()


if __name__ == "__main__":
    main()
