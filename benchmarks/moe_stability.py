"""GSPO against GRPO on a MoE whose routing moves, over seeds: the paper's claim (arXiv 2507.18071
§5.3) measured (docs/moe_stability.md).

    .venv/bin/python benchmarks/moe_stability.py                    # the default experiment: 20-30 min a seed on 2 cores
    .venv/bin/python benchmarks/moe_stability.py --plot             # + docs/img/moe_stability_*.png
    .venv/bin/python benchmarks/moe_stability.py --seeds 1 --steps 3 --runs gspo grpo   # a smoke run
    .venv/bin/python benchmarks/moe_stability.py --model /models/Qwen3-30B-A3B \\
        --layout tensor=2,expert=4 --nproc 8 --url http://node:30000    # on GPUs, a larger model

The task is the counting task (tools/make_counting_task.py): responses of about 100 tokens, some over
200, where one wrong step makes the boxed answer wrong. The model is a tiny Qwen3-MoE with 4 layers
of 16 experts, top-2 (tools/make_tiny_model.py), so that top-k sets have room to move. For each seed
s: the model is initialised with seed s, the task's training order shuffled with s, the supervised
warm start run once (train.seed s), and from that warm policy every arm trains the same steps on
the same prompt stream; only the loss (and replay) differ:

  gspo          loss.name=gspo         sequence ratio, the paper's clip 3e-4 / 4e-4
  grpo          loss.name=grpo         token ratios, the paper's clip 0.2 / 0.27
  grpo_r3       + moe.replay=true      megatron routes every token to the experts SGLang chose
  gspo_token    loss.name=gspo_token   GSPO's ratio per token (Eqs. 13-14)
  grpo_seqclip  loss.name=grpo, GSPO's clip range scaled to the token level: a sequence ratio is
                the geometric mean of L token ratios, so with independent token log-ratios its
                spread is 1/sqrt(L) of a token's; eps = GSPO's eps x sqrt(mean response length),
                so that a difference cannot be blamed on the clip range alone

Every run is `gspo-megatron train` (examples/tiny_moe_counting.yaml) against one SGLang server the
script starts (or --url), which returns its routed experts (R3 and routing/engine_mismatch). The
runs are kept under --out: a rerun skips every finished run (a run is finished when its
summary.json exists) and redoes an unfinished one. Rollouts on CPU are not seeded (SGLang's CPU
backend refuses deterministic inference): sampling noise is part of what the spread over seeds shows.

Collapse (defined before looking at the results): a run collapsed when the mean reward of its last
10 steps is below half of its best mean reward over 10 consecutive steps, and at least 0.1 below it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GSPO_CLIP = (3e-4, 4e-4)  # gspo_megatron/algorithms/registry.py: the paper's
ARMS = {"gspo": ["loss.name=gspo"], "grpo": ["loss.name=grpo"],
        "grpo_r3": ["loss.name=grpo", "moe.replay=true"], "gspo_token": ["loss.name=gspo_token"],
        "grpo_seqclip": ["loss.name=grpo"]}  # + the scaled clip range, from the task (seqclip_sets)
CONFIG = "examples/tiny_moe_counting.yaml"


def seqclip_sets(mean_length: float) -> list[str]:
    scale = math.sqrt(mean_length)
    return [f"loss.eps_low={GSPO_CLIP[0] * scale:.3g}", f"loss.eps_high={GSPO_CLIP[1] * scale:.3g}"]


def mean_response_tokens(task_file: Path, model: Path) -> float:
    """The mean length of the task's worked-out responses in the model's tokens (+ EOS)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in task_file.read_text().splitlines() if line.strip()]
    return sum(len(tok.encode(r["solution"], add_special_tokens=False)) + 1 for r in rows) / len(rows)


def prepare_seed(args, seed: int) -> tuple[Path, Path]:
    """The seed's task folder (train.jsonl shuffled with the seed, eval.jsonl) and model."""
    from tools.make_counting_task import make_counting_task
    task = Path(args.out) / "task" / f"seed{seed}"
    if not (task / "eval.jsonl").is_file():
        make_counting_task(task, seed=seed)
    if args.model:
        return task, Path(args.model)
    model = Path(args.out) / "models" / f"seed{seed}"
    if not (model / "config.json").is_file():
        from tools.make_tiny_model import make_tiny_model
        make_tiny_model("qwen3_moe", model, seed=seed, num_hidden_layers=args.layers,
                        num_experts=args.experts, num_experts_per_tok=2)
    return task, model


def train(args, sets: list[str], log: Path) -> None:
    """One `gspo-megatron train` (under torchrun with --nproc > 1); its output goes to `log`."""
    exe = shutil.which("gspo-megatron") or str(ROOT / ".venv" / "bin" / "gspo-megatron")
    cmd = [exe, "train", args.config]
    if args.nproc > 1:
        cmd = [str(Path(exe).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.nproc}", *cmd]
    layout = [f"parallel.{kv}" for kv in args.layout.split(",")] if args.layout else []
    for s in [*layout, *sets, *args.set]:
        cmd += ["--set", s]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"[bench] {' '.join(cmd)}\nexited {proc.returncode}; its log {log} ends:\n{tail}")


def common_sets(task: Path, url: str, seed: int, out: Path) -> list[str]:
    return [f"rollout.prompts={task / 'train.jsonl'}", f"eval.prompts={task / 'eval.jsonl'}",
            f"rollout.server_urls=[{url}]", f"train.seed={seed}", "checkpoint.dir=null",
            "checkpoint.export_hf=null", f"logging.tensorboard_dir={out / 'tb'}"]


def warm_start(args, seed: int, task: Path, model: Path, url: str) -> Path:
    """The seed's warm policy (train.warm_start_steps on the task's solutions), made once."""
    out = Path(args.out) / "warm" / f"seed{seed}"
    if args.warm_start_steps == 0:
        return model
    if (out / "hf" / "config.json").is_file():
        return out / "hf"
    shutil.rmtree(out, ignore_errors=True)
    print(f"[bench] seed {seed}: warm start ({args.warm_start_steps} supervised steps)", flush=True)
    sets = common_sets(task, url, seed, out) + [
        f"model.hf_path={model}", "train.steps=0", f"train.warm_start_steps={args.warm_start_steps}",
        f"checkpoint.dir={out / 'ckpt'}", f"checkpoint.export_hf={out / 'hf'}"]
    train(args, sets, out / "train.log")
    shutil.rmtree(out / "ckpt", ignore_errors=True)  # the export is what the arms start from
    return out / "hf"


def run_arm(args, arm: str, seed: int, task: Path, warm: Path, url: str, extra: list[str]) -> dict:
    """One arm from the seed's warm policy; its per-step metrics (kept: a rerun reads them)."""
    from gspo_megatron.run.metrics import read_jsonl
    out = Path(args.out) / "runs" / arm / f"seed{seed}"
    done = out / "summary.json"
    if not done.is_file():
        shutil.rmtree(out, ignore_errors=True)
        print(f"[bench] seed {seed}: {arm} ({args.steps} steps)", flush=True)
        sets = common_sets(task, url, seed, out) + [
            f"model.hf_path={warm}", "train.warm_start_steps=0", f"train.steps={args.steps}",
            f"eval.interval={args.eval_interval}", *ARMS[arm], *extra]
        train(args, sets, out / "train.log")
        steps = read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)
        rewards = [r["rollout/reward_mean"] for r in steps]
        done.write_text(json.dumps({"arm": arm, "seed": seed, "sets": sets, "steps": len(steps),
                                    "collapsed": collapsed(rewards)}, indent=1) + "\n")
    return {int(r["step"]): r for r in read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)}


def start_server(args, model: Path):
    """One SGLang server for every run (each run loads its own weights into it at start)."""
    from rollout.servers.launch import ServerConfig, ServerGroup
    config = ServerConfig(model_path=str(model), return_routed_experts=True,
                          log_dir=str(Path(args.out) / "server_logs"))
    print(f"[bench] starting an SGLang server for {model}", flush=True)
    return ServerGroup.launch(config)


# --- the report -------------------------------------------------------------------------------------
COLUMNS = (("rollout/reward_mean", "reward"), ("train/clip_fraction", "clip fraction"),
           ("routing/drift", "routing drift"), ("train/grad_norm", "grad norm"),
           ("rollout/response_length_mean", "response length"))


def collapsed(rewards: list[float], window: int = 10) -> bool:
    """The mean reward of the last `window` steps is below half of the best mean over `window`
    consecutive steps, and at least 0.1 below it (the module docstring's definition)."""
    if len(rewards) < window:
        return False
    means = [sum(rewards[i:i + window]) / window for i in range(len(rewards) - window + 1)]
    best, last = max(means), means[-1]
    return last < 0.5 * best and last <= best - 0.1


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def _run_value(run: dict[int, dict], key: str, which: slice) -> float | None:
    vals = [run[s][key] for s in sorted(run)[which] if key in run[s]]
    return sum(vals) / len(vals) if vals else None


def paired_difference(a: dict[int, float], b: dict[int, float], resamples: int = 10000) -> tuple[float, float, float]:
    """Mean over seeds of a[s] - b[s] and its 95% bootstrap interval (seeds resampled; runs of one
    seed share the warm start, so the difference is paired)."""
    import random
    diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(0)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(resamples))
    return sum(diffs) / len(diffs), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def report(results: dict[str, dict[int, dict[int, dict]]], commit: str, steps: int, length: float) -> str:
    """The table per arm (mean ± std over seeds), the GSPO - GRPO difference, and the last line
    `stability: <arm> <mean> ± <std> (<collapsed>/<N> collapsed); ...`."""
    lines = [f"\nmoe_stability at {commit}: {steps} steps per run, mean response length of the task "
             f"{length:.1f} tokens", "",
             "| arm | seeds | reward, first 5 steps | reward, last 10 steps | collapsed | "
             + " | ".join(name for _, name in COLUMNS[1:]) + " |",
             "|---|---|---|---|---|" + "---|" * (len(COLUMNS) - 1)]
    last10: dict[str, dict[int, float]] = {}
    finals = []
    for arm, runs in results.items():
        first = [v for r in runs.values() if (v := _run_value(r, "rollout/reward_mean", slice(0, 5))) is not None]
        last10[arm] = {s: v for s, r in runs.items()
                       if (v := _run_value(r, "rollout/reward_mean", slice(-10, None))) is not None}
        down = sum(collapsed([r[s]["rollout/reward_mean"] for s in sorted(r)]) for r in runs.values())
        cells = []
        for key, _ in COLUMNS[1:]:
            vals = [v for r in runs.values() if (v := _run_value(r, key, slice(None))) is not None]
            m, sd = _mean_std(vals)
            cells.append("-" if not vals else f"{m:.4g} ± {sd:.2g}")
        (fm, fs), (lm, ls) = _mean_std(first), _mean_std(list(last10[arm].values()))
        lines.append(f"| {arm} | {len(runs)} | {fm:.3f} ± {fs:.3f} | {lm:.3f} ± {ls:.3f} | {down}/{len(runs)} | "
                     + " | ".join(cells) + " |")
        finals.append(f"{arm} {lm:.3f} ± {ls:.3f} ({down}/{len(runs)} collapsed)")
    lines.append("")
    lines.append("(mean ± std over seeds of each run's mean; clip fraction: of sequences for gspo, of "
                 "tokens otherwise; routing drift: (token, layer) top-2 sets changed by a step's updates)")
    if "gspo" in last10 and "grpo" in last10:
        d, lo, hi = paired_difference(last10["gspo"], last10["grpo"])
        lines.append(f"GSPO - GRPO, reward of the last 10 steps: {d:+.3f} (95% bootstrap interval over "
                     f"seeds, paired: [{lo:+.3f}, {hi:+.3f}])")
    lines.append("stability: " + "; ".join(finals))
    return "\n".join(lines)


def write_plots(results: dict[str, dict[int, dict[int, dict]]], out_dir: Path) -> list[Path]:
    """One PNG per column: each arm's mean over seeds per step, with a band of ± one std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name in COLUMNS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
        for arm, runs in results.items():
            steps = sorted(set().union(*runs.values())) if runs else []
            xs, mean, std = [], [], []
            for step in steps:
                vals = [r[step][key] for r in runs.values() if step in r and key in r[step]]
                if vals:
                    m, sd = _mean_std(vals)
                    xs.append(step), mean.append(m), std.append(sd)
            if xs:
                ax.plot(xs, mean, label=arm)
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.set_title(f"{name} (mean ± std over seeds)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"moe_stability_{key.split('/')[-1]}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=20, help="RL steps of every run")
    p.add_argument("--runs", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM",
                   help=f"arms to run, of {', '.join(ARMS)}")
    p.add_argument("--warm-start-steps", type=int, default=500)
    p.add_argument("--eval-interval", type=int, default=0, help="held-out eval every N steps (0: none)")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny MoE")
    p.add_argument("--experts", type=int, default=16, help="experts of the tiny MoE (top-2)")
    p.add_argument("--model", help="an HF MoE to use for every seed instead of the tiny one (GPU)")
    p.add_argument("--layout", help="parallel layout, e.g. tensor=2,expert=4 (with --nproc)")
    p.add_argument("--nproc", type=int, default=1, help="trainer ranks (torchrun)")
    p.add_argument("--url", help="an SGLang server to use (started with --enable-return-routed-experts)")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--set", action="append", default=[], help="an override for every run")
    p.add_argument("--out", default=str(ROOT / "runs" / "moe_stability"), help="where the runs are kept")
    p.add_argument("--plot", action="store_true", help="write the figures (matplotlib)")
    p.add_argument("--plot-dir", default=str(ROOT / "docs" / "img"))
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    seeds = list(range(args.seeds))
    prepared = {s: prepare_seed(args, s) for s in seeds}
    task0, model0 = prepared[seeds[0]]
    length = mean_response_tokens(task0 / "train.jsonl", model0)
    extra = {arm: seqclip_sets(length) if arm == "grpo_seqclip" else [] for arm in args.runs}
    print(f"[bench] mean response length of the task: {length:.1f} tokens; grpo_seqclip: "
          f"{' '.join(seqclip_sets(length))}", flush=True)
    server = None if args.url else start_server(args, model0)
    url = args.url or server.server_urls[0]
    results: dict[str, dict[int, dict[int, dict]]] = {arm: {} for arm in args.runs}
    try:
        for s in seeds:
            task, model = prepared[s]
            warm = warm_start(args, s, task, model, url)
            for arm in args.runs:
                results[arm][s] = run_arm(args, arm, s, task, warm, url, extra[arm])
    finally:
        if server is not None:
            server.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(report(results, commit=commit, steps=args.steps, length=length))
    if args.plot:
        for path in write_plots(results, Path(args.plot_dir)):
            print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
