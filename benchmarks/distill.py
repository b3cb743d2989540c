"""On-policy distillation against GSPO on the reward alone: the same student, steps and seed.

    .venv/bin/python benchmarks/distill.py                 # teacher: the main job's export (made if missing)
    .venv/bin/python benchmarks/distill.py --steps 30 --every 5

Two runs of `gspo-megatron train examples/tiny_moe_distill.yaml` (a freshly warm-started tiny MoE
student; the teacher is the main job's trained policy, runs/tiny_moe_larger_digit/final_hf):
  distill   distill.reward_coef=0, coef=1: no task reward reaches the student, only the teacher's
            per-token log-probs (docs/algorithm.md, "On-policy distillation");
  gspo      distill.coef=0, reward_coef=1: GSPO on the exact-match reward alone (GSPO-token with
            one advantage per sequence is GSPO); the teacher still scores, for the reverse KL column.
Both attach to one student and one teacher SGLang server started here (CPU), in turn; each run
syncs its own initial policy into the student server first. Per printed step: the task accuracy
of the step's responses (rollout/accuracy) and the reverse KL of the student's samples from the
teacher (distill/reverse_kl, per token). Last lines: accuracy over the first 5 steps against the
last 10, and the reverse KL at the start against the end.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = "examples/tiny_moe_distill.yaml"
TEACHER = ROOT / "runs" / "tiny_moe_larger_digit" / "final_hf"
STUDENT = ROOT / "runs" / "models" / "tiny-qwen3-moe"
RUNS = {"distill": ["distill.coef=1", "distill.reward_coef=0"], "gspo": ["distill.coef=0", "distill.reward_coef=1"]}


def run(name: str, args, out: Path, student_url: str, teacher_url: str) -> dict[int, dict[str, float]]:
    sets = [f"model.hf_path={args.student}", f"distill.teacher={args.teacher}", f"train.steps={args.steps}",
            f"train.warm_start_steps={args.warm_start_steps}", f"rollout.server_urls=[{student_url}]",
            f"distill.teacher_server_urls=[{teacher_url}]", f"checkpoint.dir={out / name / 'ckpt'}",
            f"logging.tensorboard_dir={out / name / 'tb'}", "logging.progress=false", *RUNS[name], *args.set]
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", CONFIG]
    for s in sets:
        cmd += ["--set", s]
    print(f"[bench] {name}: {' '.join(sets)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    from gspo_megatron.run.metrics import read_jsonl
    return {int(r["step"]): r for r in read_jsonl(out / name / "tb" / "metrics.jsonl", steps_only=True)}


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="print every N-th step (and the last)")
    p.add_argument("--warm-start-steps", type=int, default=40)
    p.add_argument("--teacher", default=str(TEACHER), help="the teacher's HF folder (default: the main job's export)")
    p.add_argument("--student", default=str(STUDENT), help="the student's HF folder (made if it is the default)")
    p.add_argument("--student-url", help="a server already serving the student's architecture")
    p.add_argument("--teacher-url", help="a server already serving the teacher")
    p.add_argument("--set", action="append", default=[], help="extra overrides for both runs")
    p.add_argument("--out", help="where the runs go (default: a temporary folder)")
    args = p.parse_args(argv)
    if not (Path(args.teacher) / "config.json").is_file():
        if Path(args.teacher) != TEACHER:
            p.error(f"--teacher {args.teacher}: no config.json there")
        print("[bench] no teacher yet: running the main job (bash scripts/main_job.sh) to make it", flush=True)
        subprocess.run(["bash", "scripts/main_job.sh"], cwd=ROOT, check=True)
    if not (Path(args.student) / "config.json").is_file():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--arch", "qwen3_moe", "--out", args.student,
                        "--seed", "0"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from rollout.servers.launch import ServerConfig, ServerGroup
    out = Path(args.out or tempfile.mkdtemp(prefix="gspo-bench-distill-"))
    student = (ServerGroup.attach([args.student_url]) if args.student_url else
               ServerGroup.launch(ServerConfig(model_path=args.student, device="cpu")))
    with student:
        teacher = (ServerGroup.attach([args.teacher_url]) if args.teacher_url else
                   ServerGroup.launch(ServerConfig(model_path=args.teacher, device="cpu")))
        with teacher:
            results = {n: run(n, args, out, student.server_urls[0], teacher.server_urls[0]) for n in RUNS}
    print(f"\n{CONFIG}: student {args.student}, teacher {args.teacher}, {args.steps} steps, same seed")
    print(f"{'step':>4} | {'distill acc':>11} {'rev KL':>7} | {'GSPO acc':>9} {'rev KL':>7}")
    print("-" * 48)
    steps = sorted(set(results["distill"]) | set(results["gspo"]))
    for step in [s for s in steps if s % args.every == 0 or s == steps[-1]]:
        cells = [f"{results[n].get(step, {}).get('rollout/accuracy', float('nan')):>{w}.3f} "
                 f"{results[n].get(step, {}).get('distill/reverse_kl', float('nan')):>7.3f}"
                 for n, w in (("distill", 11), ("gspo", 9))]
        print(f"{step:>4} | {cells[0]} | {cells[1]}")
    for n in RUNS:
        rows = [results[n][s] for s in sorted(results[n])]
        print(f"{n}: accuracy first 5 steps {mean(rows[:5], 'rollout/accuracy'):.3f} -> last 10 "
              f"{mean(rows[-10:], 'rollout/accuracy'):.3f}; reverse KL first 5 {mean(rows[:5], 'distill/reverse_kl'):.3f}"
              f" -> last 10 {mean(rows[-10:], 'distill/reverse_kl'):.3f}")


if __name__ == "__main__":
    main()
