"""GSPO vs GRPO on the same task and seeds: reward per step side by side.

    .venv/bin/python benchmarks/gspo_vs_grpo.py                       # the main job's task and length (100 steps)
    .venv/bin/python benchmarks/gspo_vs_grpo.py --steps 60 --set rollout.prompts_per_step=8

Runs `gspo-megatron train` twice with one config (examples/tiny_moe_larger_digit.yaml by default),
changing only loss.name (gspo: the paper's clip 3e-4/4e-4; grpo: 0.2/0.27), each in its own run
directory under runs/gspo_vs_grpo/, then prints reward mean, accuracy and clip fraction per step.
Same model, prompts, warm start and seeds; rollouts are sampled (not seeded on CPU), so small
differences between the two runs are also sampling noise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(loss: str, args) -> dict[int, dict[str, float]]:
    out = Path(args.out) / loss
    cmd = [str(ROOT / ".venv" / "bin" / "gspo-megatron"), "train", args.config,
           "--set", f"loss.name={loss}", "--set", f"train.steps={args.steps}",
           "--set", f"checkpoint.dir={out / 'ckpt'}", "--set", "checkpoint.export_hf=null",
           "--set", f"logging.tensorboard_dir={out / 'tb'}"]
    for s in args.set:
        cmd += ["--set", s]
    if not args.resume and out.exists():
        import shutil
        shutil.rmtree(out)
    print(f"[bench] {loss}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    from gspo_megatron.run.metrics import read_jsonl
    return {int(r["step"]): r for r in read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/tiny_moe_larger_digit.yaml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=5, help="print every N-th step (and the last)")
    p.add_argument("--set", action="append", default=[], help="extra overrides for both runs")
    p.add_argument("--resume", action="store_true", help="keep earlier run dirs (resume them)")
    p.add_argument("--out", default=str(ROOT / "runs" / "gspo_vs_grpo"), help="where the two runs go")
    args = p.parse_args(argv)
    model = ROOT / "runs" / "models" / "tiny-qwen3-moe"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch",
                        "qwen3_moe", "--out", str(model), "--seed", "0"], check=True)
    gspo, grpo = run("gspo", args), run("grpo", args)
    print(f"\n{'step':>4} | {'GSPO reward':>11} {'acc':>5} {'clip':>6} | {'GRPO reward':>11} "
          f"{'acc':>5} {'clip':>6}")
    print("-" * 60)
    steps = sorted(set(gspo) | set(grpo))
    for step in [s for s in steps if s % args.every == 0 or s == steps[-1]]:
        cells = []
        for res in (gspo, grpo):
            r = res.get(step, {})
            cells.append(f"{r.get('rollout/reward_mean', float('nan')):>11.3f} "
                         f"{r.get('rollout/accuracy', float('nan')):>5.2f} "
                         f"{r.get('train/clip_fraction', float('nan')):>6.3f}")
        print(f"{step:>4} | {cells[0]} | {cells[1]}")
    for name, res in (("GSPO", gspo), ("GRPO", grpo)):
        last = [res[s]["rollout/reward_mean"] for s in sorted(res)[-5:]]
        print(f"{name}: mean reward of the last {len(last)} steps {sum(last) / len(last):.3f}")
    print("(clip: fraction of sequences clipped for GSPO, of tokens for GRPO)")


if __name__ == "__main__":
    main()
