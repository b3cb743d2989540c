"""The report of benchmarks/moe_stability.py: one table per set of runs, the rules that say whether a
run collapsed or learned (fixed before any run of the experiment they serve), per-seed rewards,
paired differences over seeds, and the figures.

A run is {step: {metric: value}} (metrics.jsonl's step records); results are {arm: {seed: run}}.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

Run = dict[int, dict[str, float]]
Results = dict[str, dict[int, Run]]

COLUMNS = (("rollout/reward_mean", "reward"), ("train/clip_fraction", "clip fraction"),
           ("routing/drift", "routing drift"), ("train/grad_norm", "grad norm"),
           ("rollout/response_length_mean", "response length"), ("eval/accuracy", "held-out accuracy"))
REWARD = "rollout/reward_mean"
HELD_OUT = "eval/accuracy"  # greedy, held out: at step 0 and after the last step (a column of its own)
PAPER_DRIFT = 0.10  # arXiv 2507.18071 §5.3: about 10% of activated experts change after one update


def collapsed(rewards: list[float], window: int = 10) -> bool:
    """The mean reward of the last `window` steps is below half of the best mean over `window`
    consecutive steps, and at least 0.1 below it (the module docstring's definition)."""
    if len(rewards) < window:
        return False
    means = [sum(rewards[i:i + window]) / window for i in range(len(rewards) - window + 1)]
    best, last = max(means), means[-1]
    return last < 0.5 * best and last <= best - 0.1


def first_last(rewards: list[float]) -> tuple[float, float]:
    """The mean reward of the first 5 steps and of the last 10 (the learning rule's two ends)."""
    return sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-10:]) / len(rewards[-10:])


def learned(rewards: list[float]) -> bool:
    """A run learned ("up") when the mean reward of its last 10 steps is above that of its first 5."""
    first, last = first_last(rewards)
    return last > first


def rewards_of(run: Run) -> list[float]:
    return [run[s][REWARD] for s in sorted(run) if REWARD in run[s]]


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def held_out_ends(run: Run) -> tuple[float, float] | None:
    """The held-out accuracy of the first eval and of the last (step 0 and after the last step)."""
    vals = [run[s][HELD_OUT] for s in sorted(run) if HELD_OUT in run[s]]
    return (vals[0], vals[-1]) if len(vals) >= 2 else None


def run_value(run: Run, key: str, which: slice = slice(None)) -> float | None:
    vals = [run[s][key] for s in sorted(run)[which] if key in run[s]]
    return sum(vals) / len(vals) if vals else None


def paired_difference(a: dict[int, float], b: dict[int, float], resamples: int = 10000) -> tuple[float, float, float]:
    """Mean over seeds of a[s] - b[s] and its 95% bootstrap interval (seeds resampled; runs of one
    seed share the warm start, so the difference is paired)."""
    diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(0)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(resamples))
    return sum(diffs) / len(diffs), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def fisher_two_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """Fisher's exact test, two-sided, of k1/n1 against k2/n2 (the tables as likely as the observed
    one or less, summed)."""
    total, hits = n1 + n2, k1 + k2

    def p(k: int) -> float:
        return math.comb(n1, k) * math.comb(n2, hits - k) / math.comb(total, hits)

    observed = p(k1)
    return min(1.0, sum(p(k) for k in range(max(0, hits - n2), min(n1, hits) + 1) if p(k) <= observed * (1 + 1e-9)))


def report(results: Results, commit: str, steps: int, length: float, regime: str) -> str:
    """The table per arm (mean ± std over seeds), paired differences against gspo, the per-seed
    rewards, the drift beside the paper's, and the last two lines
    `learning: <arm> <first-5> -> <last-10> (<k>/<N> seeds up); ...` and
    `stability: <arm> <mean> ± <std> (<collapsed>/<N> collapsed); ...`."""
    lines = [f"\nmoe_stability at {commit}, regime {regime}: {steps} steps per run, mean response length "
             f"of the task {length:.1f} tokens", "",
             "| arm | seeds | reward, first 5 steps | reward, last 10 steps | seeds up | collapsed | "
             + " | ".join(name for key, name in COLUMNS[1:] if key != HELD_OUT) + " | held-out accuracy, start -> end |",
             "|---|---|---|---|---|---|" + "---|" * (len(COLUMNS) - 1)]
    last10: dict[str, dict[int, float]] = {}
    learning, stability, drift = [], [], []
    for arm, runs in results.items():
        ends = {s: first_last(rewards_of(r)) for s, r in runs.items() if rewards_of(r)}
        last10[arm] = {s: last for s, (_, last) in ends.items()}
        up = sum(learned(rewards_of(r)) for r in runs.values() if rewards_of(r))
        down = sum(collapsed(rewards_of(r)) for r in runs.values())
        cells = []
        for key, _ in COLUMNS[1:]:
            if key == HELD_OUT:
                continue
            vals = [v for r in runs.values() if (v := run_value(r, key)) is not None]
            m, sd = mean_std(vals)
            cells.append("-" if not vals else f"{m:.4g} ± {sd:.2g}")
        evals = [e for r in runs.values() if (e := held_out_ends(r)) is not None]
        cells.append("-" if not evals else f"{mean_std([a for a, _ in evals])[0]:.3f} -> "
                     f"{mean_std([b for _, b in evals])[0]:.3f} ({sum(b > a for a, b in evals)}/{len(evals)} up)")
        (fm, fs), (lm, ls) = mean_std([f for f, _ in ends.values()]), mean_std(list(last10[arm].values()))
        n = len(runs)
        lines.append(f"| {arm} | {n} | {fm:.3f} ± {fs:.3f} | {lm:.3f} ± {ls:.3f} | {up}/{n} | {down}/{n} | "
                     + " | ".join(cells) + " |")
        learning.append(f"{arm} {fm:.3f} -> {lm:.3f} ({up}/{n} seeds up)")
        stability.append(f"{arm} {lm:.3f} ± {ls:.3f} ({down}/{n} collapsed)")
        d = [v for r in runs.values() if (v := run_value(r, "routing/drift")) is not None]
        if d:
            drift.append(f"{arm} {100 * sum(d) / len(d):.1f}%")
    lines += ["", "(mean ± std over seeds of each run's mean; seeds up: last 10 steps above the first 5; "
              "clip fraction: of sequences for gspo, of tokens otherwise; routing drift: (token, layer) "
              "top-k sets changed by a step's updates)"]
    for arm in (a for a in results if a != "gspo" and "gspo" in last10):
        diff, lo, hi = paired_difference(last10["gspo"], last10[arm])
        lines.append(f"GSPO - {arm}, reward of the last 10 steps: {diff:+.3f} (95% bootstrap interval over "
                     f"seeds, paired: [{lo:+.3f}, {hi:+.3f}])")
    lines += ["", per_seed_table(results)]
    if drift:
        lines.append(f"routing drift per step (paper: ~{PAPER_DRIFT:.0%} on a 48-layer MoE): " + ", ".join(drift))
    lines.append("learning: " + "; ".join(learning))
    lines.append("stability: " + "; ".join(stability))
    return "\n".join(lines)


def per_seed_table(results: Results) -> str:
    """Per seed, the reward of the first 5 steps -> the last 10 (C: collapsed), and in brackets the
    held-out accuracy at the start -> the end where the runs evaluated it."""
    seeds = sorted(set().union(*results.values())) if results else []
    rows = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for arm, runs in results.items():
        cells = []
        for s in seeds:
            rewards = rewards_of(runs[s]) if s in runs else []
            if not rewards:
                cells.append("-")
                continue
            first, last = first_last(rewards)
            ends = held_out_ends(runs[s])
            cells.append(f"{first:.2f} -> {last:.2f}" + (" C" if collapsed(rewards) else "")
                         + (f" [{ends[0]:.2f} -> {ends[1]:.2f}]" if ends else ""))
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_plots(results: Results, out_dir: Path, prefix: str = "moe_stability") -> list[Path]:
    """One PNG per column with data: each arm's mean over seeds per step, with a band of ± one std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name in COLUMNS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
        drawn = False
        for arm, runs in results.items():
            steps = sorted(set().union(*runs.values())) if runs else []
            xs: list[int] = []
            mean: list[float] = []
            std: list[float] = []
            for step in steps:
                vals = [r[step][key] for r in runs.values() if step in r and key in r[step]]
                if vals:
                    m, sd = mean_std(vals)
                    xs.append(step)
                    mean.append(m)
                    std.append(sd)
            if xs:
                drawn = True
                ax.plot(xs, mean, label=arm, marker="o" if len(xs) < 15 else None, markersize=3)
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.15)
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.set_title(f"{name} (mean ± std over seeds)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"{prefix}_{key.split('/')[-1]}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
