"""The context-parallel row of tools/gpu_check.py: CP2 against CP1 on the Transformer Engine spec.

    row = cp_row(out, hf_dir, mcore_dir, batch)        # gpu_check.py, on a machine with >= 2 GPUs
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu_check_cp.py \
        --hf DIR --mcore DIR --batch FILE --context 2 --out FILE         # one run (what cp_row does)

Context parallelism needs Transformer Engine's attention on CUDA (megatron's local attention has
no CP) and one GPU per CP rank (NCCL refuses two ranks on one device); TE has no fp32 attention
backend with CP, so both runs are bf16. Each run, in a fresh torchrun job: the actor (TE spec,
SGD, GSPO) loaded from the converted checkpoint, the old log-probs of gpu_check's batch (full rows,
gathered over CP), one on-policy GSPO step on them, and the log-probs after the step; rank 0 writes
them with the step's metrics. The row compares CP2 with CP1: log-probs before and after the step
within the bf16 tolerance, the on-policy loss and the sequence/token counts equal (metrics not
counted per CP rank), the gradient norm within 5%.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BF16_TOL = 0.1  # nats, as gpu_check.py: two bf16 computations of the tiny model's log-probs
GRAD_NORM_RTOL = 0.05
LR = 0.1  # SGD: large enough for the step to move the log-probs visibly


def run(hf: Path, mcore: Path, batch_file: Path, context: int, out: Path) -> None:
    """One torchrun job (every rank calls it)."""
    import torch
    import torch.distributed as dist

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import ComputeSettings, MicroBatchSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.process_groups import destroy_process_groups
    batch = torch.load(batch_file, weights_only=False)
    actor = Actor(str(hf), ParallelLayout(context=context),
                  optimizer=OptimizerSettings(optimizer="sgd", lr=LR, clip_grad=0.0),
                  loss=LossSettings(name="gspo", eps_low=0.5, eps_high=0.5),
                  batching=MicroBatchSettings(micro_batch_size=2, pack_sequences=False),
                  params_dtype=torch.bfloat16,  # CP needs 16-bit attention (layout.py)
                  compute=ComputeSettings(transformer_engine=True))
    actor.load_weights(mcore)
    result = on_policy_step(actor, batch, layout=actor.layout.describe(dist.get_world_size()))
    if dist.get_rank() == 0:
        torch.save(result, out)
    destroy_process_groups()


def on_policy_step(actor, batch, layout: str) -> dict:
    """The old log-probs of `batch` (every row: DP = 1), one on-policy GSPO step on them, the
    log-probs after it, and the step's metrics: what compare() reads."""
    shard = actor.shard(batch)
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    metrics = actor.train_step(shard)
    after, _ = actor.compute_old_log_probs(shard)
    return dict(lp=shard.old_log_probs, after=after, layout=layout,
                **{k: metrics[k] for k in ("loss", "grad_norm", "num_sequences", "tokens")})


def compare(cp1: dict, cp2: dict, mask, tol: float = BF16_TOL, spec: str = "te CP2", dtype: str = "bf16") -> dict:
    """Run 2 against run 1 (each: log-probs before and after one on-policy step, and the step's
    metrics). Also what gpu_check.py's packed-vs-padded comparison uses, with its dtype's `tol`."""
    import torch
    d_lp = (cp2["lp"] - cp1["lp"]).abs()[mask]
    d_after = (cp2["after"] - cp1["after"]).abs()[mask]
    step1, step2 = (cp1["after"] - cp1["lp"])[mask], (cp2["after"] - cp2["lp"])[mask]
    row: dict[str, Any] = dict(spec=spec, dtype=dtype, tol=tol, layouts=f"{cp2['layout']} vs {cp1['layout']}",
               lp_max=float(d_lp.max()), lp_mean=float(d_lp.mean()), after_max=float(d_after.max()),
               step_cos=float(torch.nn.functional.cosine_similarity(step1, step2, dim=0)),
               loss=(cp1["loss"], cp2["loss"]), grad_norm=(cp1["grad_norm"], cp2["grad_norm"]),
               counts=((cp1["num_sequences"], cp1["tokens"]), (cp2["num_sequences"], cp2["tokens"])))
    g1, g2 = row["grad_norm"]
    row["ok"] = (row["lp_max"] <= tol and row["after_max"] <= tol
                 and abs(cp1["loss"] - cp2["loss"]) <= 1e-3 and row["counts"][0] == row["counts"][1]
                 and abs(g2 - g1) <= GRAD_NORM_RTOL * max(abs(g1), 1e-12))
    return row


def cp_row(out: Path, hf_dir: Path, mcore: Path, batch) -> dict:
    """Run CP1 and CP2 as torchrun jobs and compare them (a SKIP row with fewer than 2 GPUs)."""
    import torch
    n = torch.cuda.device_count()
    if n < 2:
        return dict(spec="te CP2", skipped=f"needs 2 GPUs, found {n}", ok=True)
    batch_file = out / "cp_batch.pt"
    torch.save(batch, batch_file)
    runs = {}
    for cp in (1, 2):
        dst = out / f"cp{cp}.pt"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={cp}", str(Path(__file__)), "--hf", str(hf_dir),
                               "--mcore", str(mcore), "--batch", str(batch_file), "--context", str(cp),
                               "--out", str(dst)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"gpu_check_cp: the CP{cp} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}",
                  file=sys.stderr)
            return dict(spec="te CP2", skipped=f"CP{cp} run failed (exit {proc.returncode})", ok=False)
        runs[cp] = torch.load(dst, weights_only=False)
    return compare(runs[1], runs[2], batch.loss_mask)


def table(row: dict) -> str:
    head = ("| spec | dtype | layouts | log-prob max / mean abs diff (tol) | after one SGD step: max diff, "
            "step cosine | loss CP1 / CP2 | grad norm CP1 / CP2 | sequences, tokens CP1 / CP2 | result |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    if "skipped" in row:
        return head + f"| {row['spec']} | bf16 | - | - | - | - | - | - | {'SKIP' if row['ok'] else 'FAIL'}: " \
                      f"{row['skipped']} |"
    (s1, t1), (s2, t2) = row["counts"]
    return head + (f"| {row['spec']} | {row['dtype']} | {row['layouts']} | {row['lp_max']:.2e} / "
                   f"{row['lp_mean']:.2e} ({BF16_TOL:g}) | {row['after_max']:.2e}, {row['step_cos']:.4f} | "
                   f"{row['loss'][0]:.4f} / {row['loss'][1]:.4f} | {row['grad_norm'][0]:.4g} / "
                   f"{row['grad_norm'][1]:.4g} | {s1:g}, {t1:g} / {s2:g}, {t2:g} | "
                   f"{'PASS' if row['ok'] else 'FAIL'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("--hf", "--mcore", "--batch", "--out"):
        p.add_argument(name, required=True, type=Path)
    p.add_argument("--context", type=int, required=True)
    a = p.parse_args()
    run(a.hf, a.mcore, a.batch, a.context, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
