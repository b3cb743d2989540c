"""The optimizer-offload row of tools/gpu_check.py: megatron's HybridDeviceOptimizer
(train.optimizer_cpu_offload) against the optimizer on the GPU, on CUDA only.

    row = offload_row(hf_dir, mcore_dir, batch)     # gpu_check.py, one GPU, in its process

Two actors of the tiny model in bf16, the distributed optimizer (Adam, DP 1), the same converted
weights and batch: one keeps Adam's state on the GPU, one on the host (offload fraction 1.0). Each
takes two GSPO steps on the batch. The row compares the second step's loss (it sees the first
update) and every weight after both: the host steps in fp32 as the GPU's Adam does, so they agree
to bf16 rounding (a weight one bf16 step apart at most: OFFLOAD_TOL, relative), and the offloaded
actor's GPU memory after the steps is below the other's by at least half of Adam's state (12 B per
parameter: the fp32 moments and main weights left the GPU).
"""
from __future__ import annotations

OFFLOAD_TOL = 2 ** -7  # relative: one bf16 step (8 bits of mantissa)


def _actor(hf_dir, offload: bool):
    import torch

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import MicroBatchSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    return Actor(str(hf_dir), ParallelLayout(),
                 optimizer=OptimizerSettings(lr=1e-3, use_distributed_optimizer=True,
                                             optimizer_cpu_offload=offload),
                 loss=LossSettings(name="gspo", eps_low=0.5, eps_high=0.5),
                 batching=MicroBatchSettings(micro_batch_size=2), params_dtype=torch.bfloat16)


def offload_row(hf_dir, mcore, batch) -> dict:
    import torch
    results = {}
    for offload in (False, True):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        try:
            with _actor(hf_dir, offload) as actor:
                actor.load_weights(mcore)
                losses = []
                for _ in range(2):
                    shard = actor.shard(batch)
                    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
                    losses.append(actor.train_step(shard)["loss"])
                params = sum(p.numel() for c in actor.chunks for p in c.parameters())
                results[offload] = dict(losses=losses, weights=actor.full_state_dict(), params=params,
                                        memory=torch.cuda.memory_allocated() - before)
        except Exception as e:  # noqa: BLE001 - a FAIL row, the rest of the table still runs
            import traceback
            traceback.print_exc()
            return dict(spec="offload", dtype="bf16", error=f"{type(e).__name__}: {e}".splitlines()[0][:200],
                        ok=False)
    gpu, host = results[False], results[True]
    rel = max(float(((host["weights"][k].float() - v.float()).abs()
                     / v.float().abs().clamp_min(1e-3)).max()) for k, v in gpu["weights"].items())
    saved = gpu["memory"] - host["memory"]
    row = dict(spec="offload", dtype="bf16", loss_gpu=gpu["losses"][1], loss_host=host["losses"][1],
               weights_rel=rel, memory_saved=saved, adam_bytes=12 * gpu["params"])
    row["ok"] = (abs(row["loss_gpu"] - row["loss_host"]) <= 1e-3 * max(1.0, abs(row["loss_gpu"]))
                 and rel <= OFFLOAD_TOL and saved >= 6 * gpu["params"])
    return row


def describe(row: dict) -> str:
    if "error" in row:
        return f"optimizer offload: FAIL ({row['error']})"
    return (f"optimizer offload (HybridDeviceOptimizer, bf16): step-2 loss {row['loss_gpu']:.6f} on the GPU, "
            f"{row['loss_host']:.6f} offloaded; weights within {row['weights_rel']:.2e} (relative, tol "
            f"{OFFLOAD_TOL:.2e}); GPU memory saved {row['memory_saved'] / 2**20:.1f} MiB of Adam's "
            f"{row['adam_bytes'] / 2**20:.1f} MiB: {'ok' if row['ok'] else 'FAIL'}")
