"""benchmarks/moe_stability.py: its command line refuses what cannot run before anything is spent
(one line, exit 2), its --help shows every default, its rules and report (benchmarks/stability/)
say what they define, and the learn regime's smoke runs every part of a run, the ratio probe
included, at the smallest size."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest

from test_benchmarks import SMALL_STEP, _run
from test_trainer_e2e import ROOT, env, server_url  # noqa: F401

SCRIPT = "benchmarks/moe_stability.py"
sys.path.insert(0, str(ROOT))
from benchmarks.stability import ratios, report  # noqa: E402
from benchmarks.stability.regimes import ARMS, REGIMES, arm_sets  # noqa: E402


def _refusal(args: list[str], tmp_path) -> str:
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not out.exists(), "refused after something was made"
    assert time.monotonic() - t0 < 20  # before torch, a model or a server (a warm start is minutes)
    return proc.stderr.strip()


@pytest.mark.parametrize("args, expected", [
    (["--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
    (["--steps", "-1"], "argument --steps: expected an integer >= 1, got -1"),
    (["--warm-start-steps", "-5"], "argument --warm-start-steps: expected an integer >= 0, got -5"),
    (["--experts", "1"], "argument --experts: expected an integer >= 2, got 1"),
    (["--layout", "tensor=2,expert=4"], "--layout tensor=2,expert=4 needs --nproc N trainer ranks (torchrun), got --nproc 1"),
    (["--layout", "tensor=2", "--nproc", "3"], "--layout tensor=2 with --nproc 3: tensor x pipeline x context = 2 does not divide the 3 ranks"),
    (["--layout", "tensor=2,experts=4", "--nproc", "8"], "argument --layout: 'experts=4': expected NAME=INTEGER pairs"),
    (["--layout", "tensor=0", "--nproc", "8"], "argument --layout: parallel.tensor must be >= 1, got 0"),
])
def test_refused_at_parse_in_one_line(args, expected, tmp_path):
    line = _refusal(args, tmp_path)
    assert line.startswith(f"moe_stability.py: error: {expected}"), line


def test_bad_inputs_refused_before_anything_is_made(tmp_path):
    """--set, --config, --model, --url and --out that would fail 15-55 s in (after the tasks, the
    models and the server) are one line at once."""
    from faults_common import dead_url
    url = dead_url()
    for args, expected in (
            (["--set", "loss.nme=grpo"], "--config examples/tiny_moe_counting.yaml with the gspo arm and --set "
                                         "loss.nme=grpo: unknown key 'loss.nme'"),
            (["--regime", "learn", "--set", "train.lr=-1"], "--config examples/tiny_moe_larger_digit.yaml with the "
                                                           "gspo arm and --set train.lr=-1: train.lr=-1.0: expected >= 0"),
            (["--config", "examples/nope.yaml"], "--config examples/nope.yaml: no such file"),
            (["--model", str(tmp_path / "missing")], f"--model {tmp_path / 'missing'}: no config.json there"),
            (["--url", url], f"--url {url}: no SGLang server answers /health there")):
        assert _refusal(args, tmp_path).startswith(f"moe_stability.py: error: {expected}"), args
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(a_file)], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (f"moe_stability.py: error: --out {a_file}: a file is there "
                                                            "(expected a folder for the runs, made if missing)")


def test_help_shows_every_default():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    blocks: dict[str, str] = {}  # option -> its help, the lines up to the next option
    for line in proc.stdout.split("options:")[1].splitlines():
        if re.match(r"^  -", line):
            option = next(t.strip(",") for t in line.split() if t.startswith("--"))
            blocks[option] = line
        elif line.strip():
            blocks[option] += " " + line.strip()
    del blocks["--help"]
    assert len(blocks) >= 15
    for option, block in blocks.items():
        assert "default" in block, f"{option}: no default in its help: {block}"
    assert "--plot write the figures" in text and "replacing the figures the docs show" in text
    for regime in REGIMES.values():  # the regime-dependent defaults name each regime's value
        assert f"{regime.name} {regime.steps}" in text and f"{regime.name} {regime.warm_start_steps}" in text


def test_collapse_and_learning_rules():
    assert report.collapsed([0.6] * 10 + [0.1] * 10)
    assert not report.collapsed([0.15] * 10 + [0.06] * 10)  # below half, but less than 0.1 below
    assert not report.collapsed([0.6] * 9)  # shorter than the window
    assert report.learned([0.1] * 5 + [0.5] * 10) and not report.learned([0.5] * 5 + [0.1] * 10)
    assert not report.learned([0.3] * 15)  # equal is not up
    assert report.first_last([0.0, 0.1, 0.2, 0.3, 0.4] + [1.0] * 10) == pytest.approx((0.2, 1.0))


def test_fisher_exact_matches_the_first_experiment():
    # docs/moe_stability.md: 0/5 against 2/5 collapsed, two-sided p = 0.44
    assert report.fisher_two_sided(0, 5, 2, 5) == pytest.approx(0.4444, abs=1e-4)
    assert report.fisher_two_sided(3, 5, 3, 5) == pytest.approx(1.0)


def test_report_learning_line_counts_seeds_up():
    up, down = [0.1] * 5 + [0.4] * 15, [0.5] * 5 + [0.2] * 15
    runs = {"gspo": {0: _run_of(up), 1: _run_of(up)}, "grpo": {0: _run_of(up), 1: _run_of(down)}}
    text = report.report(runs, commit="abc", steps=20, length=10.0, regime="learn")
    assert text.splitlines()[-2] == "learning: gspo 0.100 -> 0.400 (2/2 seeds up); grpo 0.300 -> 0.300 (1/2 seeds up)"
    assert "| gspo | 0.10 -> 0.40 | 0.10 -> 0.40 |" in text and "| grpo | 0.10 -> 0.40 | 0.50 -> 0.20 |" in text
    assert "routing drift per step (paper: ~10% on a 48-layer MoE): gspo 2.0%, grpo 2.0%" in text


def test_report_held_out_accuracy_at_both_ends():
    # the eval before step 0 is in step 0's record, the one after the last step in a record of its own
    runs = {"gspo": {0: _run_of([0.2] * 20), 1: _run_of([0.2] * 20)}}
    for seed, (start, end) in enumerate([(0.3, 0.5), (0.4, 0.35)]):
        runs["gspo"][seed][0]["eval/accuracy"] = start
        runs["gspo"][seed][20] = {"eval/accuracy": end}
    text = report.report(runs, commit="abc", steps=20, length=10.0, regime="learn")
    row = next(ln for ln in text.splitlines() if ln.startswith("| gspo | 2 |"))
    assert row.endswith("| 0.350 -> 0.425 (1/2 up) |"), row
    assert "| gspo | 0.20 -> 0.20 [0.30 -> 0.50] | 0.20 -> 0.20 [0.40 -> 0.35] |" in text
    assert "learning: gspo 0.200 -> 0.200 (0/2 seeds up)" in text  # the eval-only record is no reward


def _run_of(rewards: list[float]) -> dict[int, dict[str, float]]:
    return {i: {"rollout/reward_mean": r, "routing/drift": 0.02} for i, r in enumerate(rewards)}


def test_every_arm_of_every_regime_is_a_config_the_trainer_accepts():
    from gspo_megatron.config import load_config
    for regime in REGIMES.values():
        for arm in ARMS:
            sets = [*regime.sets, *arm_sets(arm, mean_length=80.0, max_new_tokens=regime.max_new_tokens)]
            cfg = load_config(str(ROOT / regime.config), sets)
            assert cfg.loss.name == ARMS[arm][0][0].split("=")[1], arm


def test_ratio_summary_separates_token_and_sequence_noise():
    # independent token log-ratios of spread 0.1: the token ratio's std stays ~0.1 at every length,
    # the sequence ratio's falls as 1/sqrt(L)
    import random
    rng = random.Random(0)
    rows = []
    for length in [8] * 200 + [200] * 200:
        ls = [rng.gauss(0, 0.1) for _ in range(length)]
        ws = [math.exp(x) for x in ls]
        rows.append([length, sum(ls), sum(x * x for x in ls), sum(ws), sum(w * w for w in ws),
                     sum(not 0.8 <= w <= 1.27 for w in ws)])
    table = ratios.summarise({"grpo": rows})
    cells = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in table.splitlines()[2:]}
    short, long = cells["1-15"], cells["128-255"]
    assert 0.09 < float(short[2]) < 0.11 and 0.09 < float(long[2]) < 0.11  # token ratio std
    assert float(short[3]) / float(long[3]) == pytest.approx(5.0, rel=0.2)  # sqrt(200 / 8)


def test_learn_task_is_the_main_jobs_shuffled_by_seed(tmp_path):
    """The learn regime's task: the main job's 360 training rows in a seeded order, its held-out
    file unchanged (the phrasings training never shows)."""
    regime = REGIMES["learn"]
    for seed in (0, 1):
        regime.task(tmp_path / f"seed{seed}", seed)
    shipped = (ROOT / "examples" / "data" / "larger_digit_rl.jsonl").read_text().splitlines()
    orders = [(tmp_path / f"seed{s}" / "train.jsonl").read_text().splitlines() for s in (0, 1)]
    assert all(sorted(o) == sorted(shipped) for o in orders) and orders[0] != orders[1] != shipped
    for s in (0, 1):
        assert (tmp_path / f"seed{s}" / "eval.jsonl").read_text() == \
            (ROOT / "examples" / "data" / "larger_digit_rl_eval.jsonl").read_text()
        assert sorted(p.name for p in (tmp_path / f"seed{s}").iterdir()) == ["eval.jsonl", "train.jsonl"]


@pytest.mark.slow
def test_learn_regime_smoke(server_url, tmp_path):  # noqa: F811
    """The learn regime at the smallest size, on its own task and model shape (the main job's,
    2 layers x 4 experts, against the session's server of that shape): two arms (one of them an
    estimator's), the held-out eval at both ends, the kept checkpoints, the ratio probe, the
    report and the figures."""
    out = _run([SCRIPT, "--regime", "learn", "--seeds", "1", "--steps", "2", "--runs", "gspo", "dr_grpo",
                "--warm-start-steps", "0", "--url", server_url, "--set", "moe.engine_routing=false",
                "--set", "eval.max_prompts=4", *SMALL_STEP, "--out", str(tmp_path), "--plot",
                "--plot-dir", str(tmp_path / "img")])
    assert re.search(r"^learning: gspo [0-9.]+ -> [0-9.]+ \([01]/1 seeds up\); dr_grpo ", out, re.M), out[-3000:]
    assert re.search(r"^\| gspo \| 1 \|.*\| [0-9.]+ -> [0-9.]+ \([01]/1 up\) \|$", out, re.M), out[-3000:]
    # the ratio probe: 16 prompts x 8 samples per run; responses of a few tokens fall in one bin
    assert re.search(r"^\| dr_grpo \| 1-15 \| \d+ \| \d+ \|", out, re.M), out[-3000:]
    assert len(json.loads((tmp_path / "runs" / "gspo" / "seed0" / "ratios.json").read_text())) == 16 * 8
    assert (tmp_path / "img" / "moe_stability_learn_accuracy.png").is_file()
    assert not (tmp_path / "runs" / "gspo" / "seed0" / "ckpt").exists()  # the probe's checkpoints are gone
    model = json.loads((tmp_path / "models" / "seed0" / "config.json").read_text())
    assert (model["num_hidden_layers"], model["num_local_experts"], model["num_experts_per_tok"]) == (2, 4, 2)
    summary = (tmp_path / "runs" / "dr_grpo" / "seed0" / "summary.json").read_text()
    assert "loss.advantage_estimator=dr_grpo" in summary and "loss.aggregation_args.token_sum_norm=8" in summary
