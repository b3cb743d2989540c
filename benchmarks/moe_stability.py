"""GSPO against GRPO and its relatives on a MoE whose routing moves, over seeds: the paper's claim
(arXiv 2507.18071 §5.3) measured, in two regimes (docs/moe_stability.md).

    .venv/bin/python benchmarks/moe_stability.py                  # the first experiment (collapse): 5 seeds x 5 arms x 20 steps
    .venv/bin/python benchmarks/moe_stability.py --regime learn   # the second: 5 seeds x 9 arms x 50 steps, the policy learns
    .venv/bin/python benchmarks/moe_stability.py --regime learn --pilot   # its pilot seed only (the regime search)
    .venv/bin/python benchmarks/moe_stability.py --regime learn --plot    # + docs/img/moe_stability_learn_*.png
    .venv/bin/python benchmarks/moe_stability.py --seeds 1 --steps 3 --runs gspo grpo   # a smoke run
    .venv/bin/python benchmarks/moe_stability.py --model /models/Qwen3-30B-A3B \\
        --layout tensor=2,expert=4 --nproc 8 --url http://node:30000    # on GPUs, a larger model

A regime (benchmarks/stability/regimes.py) fixes the task, the model's shape, the warm start, the
steps and the optimizer settings, the same for every arm:
- collapse (the first experiment): the counting task (tools/make_counting_task.py), responses of
  about 80 tokens, some over 200, where one wrong step makes the boxed answer wrong; a tiny
  Qwen3-MoE with 4 layers of 16 experts, top-2, so that top-k sets have room to move; 500 warm-start
  steps, 20 RL steps at lr 1e-3 (every arm degrades from its warm start there).
- learn (the second): the main job's task and model (examples/tiny_moe_larger_digit.yaml): which
  of two digits is larger (tools/make_larger_digit_task.py), responses of a few tokens, held-out
  phrasings evaluated greedily at the start and the end; a tiny Qwen3-MoE with 2 layers of 4
  experts, top-2; 80 warm-start steps that teach the format only, 50 RL steps at lr 1e-3.
For each seed s: the model is initialised with seed s, the task's training order shuffled with s,
the supervised warm start run once (train.seed s), and from that warm policy every arm trains the
same steps on the same prompt stream; only the loss (and replay, and the advantage estimator)
differ. The arms are a table too (regimes.ARMS); a regime names the ones it runs by default.

Every run is `gspo-megatron train` against one SGLang server the script starts (or --url), which
returns its routed experts (R3 and routing/engine_mismatch). The runs are kept under --out (one
folder per regime): a rerun skips every finished run (a run is finished when its summary.json
exists) and redoes an unfinished one, so an experiment can run in parts. Rollouts on CPU are not
seeded (SGLang's CPU backend refuses deterministic inference): sampling noise is part of what the
spread over seeds shows. In the learn regime each run also keeps its last two checkpoints for the
importance-ratio probe (benchmarks/stability/ratios.py), which does not need the routing to move.

Collapse (defined before looking at the results): a run collapsed when the mean reward of its last
10 steps is below half of its best mean reward over 10 consecutive steps, and at least 0.1 below it.
Learning: a run went up when the mean reward of its last 10 steps is above that of its first 5.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stability import ratios  # noqa: E402
from benchmarks.stability.regimes import ARMS, REGIMES, Regime, arm_sets, seqclip_sets  # noqa: E402
from benchmarks.stability.report import collapsed, learned, report, rewards_of, write_plots  # noqa: E402

PROBE_PROMPTS, PROBE_SAMPLES = 16, 8  # 128 responses per run for the ratio probe


def mean_response_tokens(task_file: Path, model: Path) -> float:
    """The mean length of the task's worked-out responses in the model's tokens (+ EOS)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in task_file.read_text().splitlines() if line.strip()]
    return sum(len(tok.encode(r["solution"], add_special_tokens=False)) + 1 for r in rows) / len(rows)


def prepare_seed(args, regime: Regime, seed: int) -> tuple[Path, Path]:
    """The seed's task folder (the regime's task: train.jsonl shuffled with the seed, eval.jsonl)
    and model (the regime's shape, or --layers/--experts, initialised with the seed)."""
    task = Path(args.out) / "task" / f"seed{seed}"
    if not (task / "eval.jsonl").is_file():
        regime.task(task, seed)
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
    for s in [*layout, *sets]:
        cmd += ["--set", s]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"[bench] {' '.join(cmd)}\nexited {proc.returncode}; its log {log} ends:\n{tail}")


def common_sets(args, task: Path, url: str, seed: int, out: Path) -> list[str]:
    return [f"rollout.prompts={task / 'train.jsonl'}", f"eval.prompts={task / 'eval.jsonl'}",
            f"rollout.server_urls=[{url}]", f"train.seed={seed}", "checkpoint.dir=null",
            "checkpoint.export_hf=null", f"logging.tensorboard_dir={out / 'tb'}", *args.regime_sets, *args.set]


def warm_start(args, seed: int, task: Path, model: Path, url: str) -> Path:
    """The seed's warm policy (train.warm_start_steps on the task's solutions), made once."""
    out = Path(args.out) / "warm" / f"seed{seed}"
    if args.warm_start_steps == 0:
        return model
    if (out / "hf" / "config.json").is_file():
        return out / "hf"
    shutil.rmtree(out, ignore_errors=True)
    print(f"[bench] seed {seed}: warm start ({args.warm_start_steps} supervised steps)", flush=True)
    sets = common_sets(args, task, url, seed, out) + [
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
        keep = ratios.checkpoint_sets(out / "ckpt", args.steps) if args.probe else []
        sets = common_sets(args, task, url, seed, out) + [
            f"model.hf_path={warm}", "train.warm_start_steps=0", f"train.steps={args.steps}",
            f"eval.interval={args.eval_interval}", *extra, *keep]
        train(args, sets, out / "train.log")
        if args.probe:
            t0 = time.monotonic()
            prompts = [json.loads(ln) for ln in (task / "train.jsonl").read_text().splitlines()[:PROBE_PROMPTS]]
            ratios.save(ratios.probe(out / "ckpt", prompts, seed=seed, samples=PROBE_SAMPLES,
                                     max_new_tokens=args.max_new_tokens), out / "ratios.json")
            shutil.rmtree(out / "ckpt")
            print(f"[bench] seed {seed}: {arm}: ratio probe {time.monotonic() - t0:.0f} s", flush=True)
        rewards = rewards_of({int(r["step"]): r for r in read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)})
        done.write_text(json.dumps({"arm": arm, "seed": seed, "sets": sets, "steps": len(rewards),
                                    "collapsed": collapsed(rewards), "up": learned(rewards) if rewards else None},
                                   indent=1) + "\n")
    run = {int(r["step"]): r for r in read_jsonl(out / "tb" / "metrics.jsonl", steps_only=True)}
    final = [r for r in read_jsonl(out / "tb" / "metrics.jsonl") if int(r["step"]) == args.steps]
    if final:  # the final held-out eval, logged after the last step
        run[args.steps] = final[-1]
    return run


def start_server(args, model: Path):
    """One SGLang server for every run (each run loads its own weights into it at start)."""
    from rollout.servers.launch import ServerConfig, ServerGroup
    config = ServerConfig(model_path=str(model), return_routed_experts=True,
                          log_dir=str(Path(args.out) / "server_logs"))
    print(f"[bench] starting an SGLang server for {model}", flush=True)
    return ServerGroup.launch(config)


# --- the command line: every value checked where it is parsed, refused in one line (exit 2) ----------
class Parser(argparse.ArgumentParser):
    """argparse whose refusal is the one line `moe_stability.py: error: ...` (exit 2), without the
    usage block: the line names the option, the value and what was expected."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def parse_layout(text: str) -> dict[str, int]:
    """`tensor=2,expert=4` -> the ParallelLayout fields it sets (checked: names and sizes)."""
    from dataclasses import fields
    from gspo_megatron.parallel.layout import LayoutError, ParallelLayout  # torch-free
    names = [f.name for f in fields(ParallelLayout) if f.name != "sequence_parallel"]
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in names or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=INTEGER pairs joined by commas, NAME one of "
                                             f"{', '.join(names)} (e.g. tensor=2,expert=4)")
        out[key] = int(value)
    try:
        ParallelLayout(**out).validate_sizes()  # type: ignore[arg-type]  # the size fields, ints
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def check_layout(p: Parser, layout: dict[str, int], nproc: int) -> None:
    """--layout needs --nproc trainer ranks that it divides (gspo_megatron/parallel/layout.py's
    world-size checks), before any task, model or server is made."""
    from gspo_megatron.parallel.layout import ParallelLayout
    spec = ",".join(f"{k}={v}" for k, v in layout.items())
    lay = ParallelLayout(**layout)  # type: ignore[arg-type]  # the size fields, ints
    if nproc == 1 and (lay.tensor * lay.pipeline * lay.context * lay.expert * lay.etp) > 1:
        p.error(f"--layout {spec} needs --nproc N trainer ranks (torchrun), got --nproc 1")
    for name, size in (("tensor x pipeline x context", lay.tensor * lay.pipeline * lay.context),
                       ("expert_tensor x expert x pipeline", lay.etp * lay.expert * lay.pipeline)):
        if nproc % size:
            p.error(f"--layout {spec} with --nproc {nproc}: {name} = {size} does not divide the {nproc} ranks")


def regime_default(field: str) -> str:
    return "the regime's: " + ", ".join(f"{r.name} {getattr(r, field)}" for r in REGIMES.values())


def parser() -> Parser:
    p = Parser(prog="moe_stability.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--regime", choices=list(REGIMES), default="collapse",
                   help="the experiment's settings (default collapse, the first experiment; learn: the "
                   "second, where the policy learns): " + "; ".join(f"{r.name}: {r.summary}" for r in REGIMES.values()))
    p.add_argument("--seeds", type=at_least(1), default=5, help="report seeds 0..N-1 (default 5)")
    p.add_argument("--pilot", action="store_true", help="run the regime's pilot seed only (default off; "
                   + regime_default("pilot_seed") + "), never one of the reported seeds")
    p.add_argument("--steps", type=at_least(1), help=f"RL steps of every run (default {regime_default('steps')})")
    p.add_argument("--runs", nargs="+", choices=list(ARMS), metavar="ARM",
                   help=f"arms to run, of {', '.join(ARMS)} (default: the regime's; "
                   + "; ".join(f"{r.name}: {' '.join(r.arms)}" for r in REGIMES.values()) + ")")
    p.add_argument("--warm-start-steps", type=at_least(0),
                   help=f"supervised steps before RL, once per seed (default {regime_default('warm_start_steps')})")
    p.add_argument("--eval-interval", type=at_least(0), help="held-out eval every N steps, 0: none (default "
                   f"{regime_default('eval_interval')})")
    p.add_argument("--layers", type=at_least(1), help=f"layers of the tiny MoE (default {regime_default('layers')})")
    p.add_argument("--experts", type=at_least(2), help=f"experts of the tiny MoE, top-2 (default {regime_default('experts')})")
    p.add_argument("--model", help="an HF MoE to use for every seed instead of the tiny one (GPU; default: the tiny one)")
    p.add_argument("--layout", type=parse_layout, help="parallel layout, e.g. tensor=2,expert=4; needs --nproc "
                   "(default: one rank)")
    p.add_argument("--nproc", type=at_least(1), default=1, help="trainer ranks, under torchrun (default 1)")
    p.add_argument("--url", help="an SGLang server to use, started with --enable-return-routed-experts "
                   "(default: the script starts one)")
    p.add_argument("--config", help=f"the run config (default {regime_default('config')})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run, after the regime's (repeatable; default none)")
    p.add_argument("--out", help="where the runs are kept; a rerun resumes (default runs/moe_stability for "
                   "collapse, runs/moe_stability_<regime> otherwise)")
    p.add_argument("--plot", action="store_true", help="write the figures (matplotlib) into --plot-dir, "
                   "replacing the figures the docs show (default off)")
    p.add_argument("--plot-dir", default=str(ROOT / "docs" / "img"), help="default docs/img")
    return p


def check_inputs(p: Parser, args: argparse.Namespace, regime: Regime) -> None:
    """What would otherwise fail only after the tasks, models and server are made (15-55 s in):
    --config and every arm's overrides through the trainer's config checks (torch-free), --model,
    --out and --url; each refused in one line."""
    from gspo_megatron.config import load_config
    from gspo_megatron.config.parsing import ConfigError
    config = Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config
    if not config.is_file():
        p.error(f"--config {args.config}: no such file (relative paths are to the repository, {ROOT})")
    for arm in args.runs:
        try:
            arm_overrides = arm_sets(arm, mean_length=80.0, max_new_tokens=args.max_new_tokens)
            load_config(config, [*args.regime_sets, *arm_overrides, *args.set])
        except ConfigError as e:
            p.error(f"--config {args.config} with the {arm} arm and --set {' '.join(args.set) or '(none)'}: {e}")
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (expected a Hugging Face model directory)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out}: a file is there (expected a folder for the runs, made if missing)")
    parent = next(d for d in (out, *out.parents) if d.exists())
    if not os.access(parent, os.W_OK):
        p.error(f"--out {args.out}: {parent} is not writable")
    if args.url:
        import urllib.request
        try:
            urllib.request.urlopen(args.url.rstrip("/") + "/health", timeout=5).close()
        except Exception as e:  # noqa: BLE001 - what the user sees is the one line below
            p.error(f"--url {args.url}: no SGLang server answers /health there ({e})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.layout:
        check_layout(p, args.layout, args.nproc)
    regime = REGIMES[args.regime]
    for field in ("steps", "warm_start_steps", "eval_interval", "layers", "experts", "config"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(regime, field))
    args.runs = args.runs or list(regime.arms)
    args.out = args.out or str(ROOT / "runs" / ("moe_stability" if regime.name == "collapse" else f"moe_stability_{regime.name}"))
    args.regime_sets, args.probe, args.max_new_tokens = list(regime.sets), regime.probe, regime.max_new_tokens
    for s in args.set:  # the budget Dr. GRPO normalises by, and the probe's, follow an override
        if s.startswith("rollout.max_new_tokens="):
            args.max_new_tokens = int(s.partition("=")[2])
    args.seed_list = [regime.pilot_seed] if args.pilot else list(range(args.seeds))
    check_inputs(p, args, regime)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    regime = REGIMES[args.regime]
    prepared = {s: prepare_seed(args, regime, s) for s in args.seed_list}
    task0, model0 = prepared[args.seed_list[0]]
    length = mean_response_tokens(task0 / "train.jsonl", model0)
    extra = {arm: arm_sets(arm, mean_length=length, max_new_tokens=args.max_new_tokens) for arm in args.runs}
    print(f"[bench] regime {regime.name}, seeds {args.seed_list}: mean response length of the task "
          f"{length:.1f} tokens; grpo_seqclip: {' '.join(seqclip_sets(length))}", flush=True)
    server = None if args.url else start_server(args, model0)
    url = args.url or (server.server_urls[0] if server is not None else "")
    results: dict[str, dict[int, dict[int, dict]]] = {arm: {} for arm in args.runs}
    try:
        for s in args.seed_list:
            task, model = prepared[s]
            warm = warm_start(args, s, task, model, url)
            for arm in args.runs:
                results[arm][s] = run_arm(args, arm, s, task, warm, url, extra[arm])
    finally:
        if server is not None:
            server.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(report(results, commit=commit, steps=args.steps, length=length, regime=regime.name))
    if args.probe:
        rows = {arm: [row for s in args.seed_list for row in
                      json.loads((Path(args.out) / "runs" / arm / f"seed{s}" / "ratios.json").read_text())]
                for arm in args.runs}
        print("\nimportance ratios of the last step's updates (benchmarks/stability/ratios.py), seeds pooled:\n"
              + ratios.summarise(rows))
    if args.plot:
        prefix = "moe_stability" if regime.name == "collapse" else f"moe_stability_{regime.name}"
        for path in write_plots(results, Path(args.plot_dir), prefix=prefix):
            print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
