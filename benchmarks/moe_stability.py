"""GSPO vs GRPO vs GRPO + routing replay (R3) on a tiny MoE whose routing moves: per step, reward,
routing drift, clip fraction and gradient norm side by side (GSPO paper §5.3; docs/moe_stability.md).

    .venv/bin/python benchmarks/moe_stability.py                      # 60 steps x 3 runs
    .venv/bin/python benchmarks/moe_stability.py --steps 30 --runs gspo grpo

Every run is `gspo-megatron train` on examples/tiny_moe_larger_digit.yaml with the same seeds and
warm start (60 steps here), on a variant of its tiny Qwen3-MoE with 16 experts instead of 4 (top-2,
2 layers) so that the top-k sets have room to move, and a learning rate 3x the example's. Only the
loss and moe.replay differ:
  gspo      loss.name=gspo  (paper clip 3e-4 / 4e-4)
  grpo      loss.name=grpo  (0.2 / 0.27)
  grpo_r3   loss.name=grpo, moe.replay=true (megatron routes every token to SGLang's experts)
routing/drift is measured in megatron (pi_old vs after the step's updates, trained tokens);
routing/engine_mismatch compares SGLang's routing with megatron's own choice for pi_old.
Rollouts on CPU are sampled without a seed (SGLang's CPU backend refuses deterministic
inference), so runs also differ by sampling noise: compare trends, not single steps.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {"gspo": ["loss.name=gspo"], "grpo": ["loss.name=grpo"],
        "grpo_r3": ["loss.name=grpo", "moe.replay=true"]}
MODEL_OVERRIDES = ["num_experts_per_tok=2"]
COLUMNS = (("rollout/reward_mean", "reward", "{:>6.3f}"), ("routing/drift", "drift", "{:>6.3f}"),
           ("train/clip_fraction", "clip", "{:>6.3f}"), ("train/grad_norm", "gnorm", "{:>6.2f}"))


def make_model(path: Path, experts: int) -> None:
    if (path / "config.json").is_file():
        return
    cmd = [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "qwen3_moe",
           "--out", str(path), "--seed", "0"]
    for o in [*MODEL_OVERRIDES, f"num_experts={experts}"]:
        cmd += ["--override", o]
    subprocess.run(cmd, check=True)


def run(name: str, args, model: Path) -> dict[int, dict[str, float]]:
    out = Path(args.out) / name
    if out.exists():
        shutil.rmtree(out)
    sets = [f"model.hf_path={model}", f"train.steps={args.steps}", f"train.lr={args.lr}",
            f"train.warm_start_steps={args.warm_start_steps}", "moe.engine_routing=true",
            f"checkpoint.dir={out / 'ckpt'}", "checkpoint.export_hf=null",
            f"checkpoint.interval={args.steps + 1}", f"logging.tensorboard_dir={out / 'tb'}",
            *RUNS[name], *args.set]
    cmd = [str(ROOT / ".venv" / "bin" / "gspo-megatron"), "train", args.config]
    for s in sets:
        cmd += ["--set", s]
    print(f"[bench] {name}: {' '.join(sets)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    from gspo_megatron.run.metrics import read_jsonl
    return {int(r["step"]): r for r in read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)}


def table(results: dict[str, dict[int, dict[str, float]]], every: int) -> str:
    names = list(results)
    head = f"{'step':>4} | " + " | ".join(
        f"{n:^{7 * len(COLUMNS) - 1}}" for n in names)
    sub = f"{'':>4} | " + " | ".join(" ".join(f"{c[1]:>6}" for c in COLUMNS) for _ in names)
    lines = [head, sub, "-" * len(sub)]
    steps = sorted(set().union(*results.values()))
    for step in [s for s in steps if s % every == 0 or s == steps[-1]]:
        cells = []
        for n in names:
            r = results[n].get(step, {})
            cells.append(" ".join(fmt.format(r[k]) if k in r else f"{'-':>6}" for k, _, fmt in COLUMNS))
        lines.append(f"{step:>4} | " + " | ".join(cells))
    lines.append("")
    for n in names:
        rows = [results[n][s] for s in sorted(results[n])]
        last = rows[-10:]

        def mean(key, rs):
            vals = [r[key] for r in rs if key in r]
            return sum(vals) / len(vals) if vals else float("nan")
        lines.append(f"{n:>8}: reward first 5 {mean('rollout/reward_mean', rows[:5]):.3f} -> last 10 "
                     f"{mean('rollout/reward_mean', last):.3f} | drift mean {mean('routing/drift', rows):.3f} "
                     f"max {max((r.get('routing/drift', 0.0) for r in rows), default=0.0):.3f} | "
                     f"engine/megatron routing mismatch {mean('routing/engine_mismatch', rows):.4f} | "
                     f"clip {mean('train/clip_fraction', rows):.3f} | grad norm {mean('train/grad_norm', rows):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/tiny_moe_larger_digit.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warm-start-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="print every N-th step (and the last)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--set", action="append", default=[], help="extra overrides for every run")
    p.add_argument("--out", default=str(ROOT / "runs" / "moe_stability"), help="where the runs go")
    p.add_argument("--experts", type=int, default=16, help="experts of the tiny MoE (top-2)")
    p.add_argument("--url", help="attach every run to this SGLang server (serving a tiny MoE of --experts)")
    args = p.parse_args(argv)
    if args.url:
        args.set.append(f"rollout.server_urls=[{args.url}]")
    model = ROOT / "runs" / "models" / f"tiny-qwen3-moe-e{args.experts}"
    make_model(model, args.experts)
    results = {name: run(name, args, model) for name in args.runs}
    print()
    print(table(results, args.every))
    print("(clip: fraction of sequences clipped for GSPO, of tokens for GRPO; drift: (token, layer)"
          " top-2 sets changed by the step's updates)")


if __name__ == "__main__":
    main()
