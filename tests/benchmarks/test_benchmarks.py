"""Every script in benchmarks/ runs: `--help`, and one row of each of its tables at the smallest
size, as a user runs it (a subprocess from the checkout). A benchmark that nothing runs rots:
benchmarks/async.py crashed on the final eval's record for a while before anyone noticed."""
from __future__ import annotations

import re
import subprocess
import tempfile
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from fixtures_models import tiny_model_dir
from test_trainer_e2e import ROOT, env, server_url  # noqa: F401

BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def _run(args: list[str], timeout: float = 600) -> str:
    # Output to files, not pipes: a benchmark's helper processes (run_distributed's spawn context)
    # inherit them, and a pipe is read until every holder has closed it, so run() would wait on
    # them past the benchmark's own exit.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), stdout=out, stderr=err,
                              text=True, timeout=timeout)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout


def _rows(text: str, first_cell: str) -> list[str]:
    """Markdown table rows whose first cell starts with `first_cell`."""
    return [ln for ln in text.splitlines() if re.match(rf"\|\s*{re.escape(first_cell)}", ln)]


def test_every_benchmark_has_a_smoke_test_and_a_help():
    assert set(BENCHMARKS) == set(SMOKE), "a benchmark without a smoke test here"
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda name: _run([f"benchmarks/{name}", "--help"], 120), BENCHMARKS))
    for name, out in zip(BENCHMARKS, outs):
        assert out.startswith("usage: "), name


def _line(text: str, pattern: str) -> bool:
    return any(re.match(pattern, ln) for ln in text.splitlines())


def _tiny_moe() -> str:
    return str(tiny_model_dir("qwen3_moe", 0))


# The runs' step at its smallest (the examples' is 16 prompts x 8 samples): what a smoke test shows,
# the scripts' flow and table, does not depend on it.
SMALL_STEP = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
              "--set", "train.mini_batches=1", "--set", "train.micro_batch_size=8"]

# name -> (arguments at the smallest size, a check of the printed table)
SMOKE = {
    "async.py": (lambda url: ["--staleness", "0", "--steps", "2", "--skip", "0", "--url", url,
                              "--set", f"model.hf_path={_tiny_moe()}", "--set", "train.warm_start_steps=0",
                              "--set", "eval.max_prompts=2"],
                 lambda out: len(_rows(out, "0 |")) == 1),
    "checksum.py": (lambda url: ["--hidden", "64", "--layers", "1", "--experts", "2", "--repeats", "1"],
                    lambda out: "|" in out),
    "data_path.py": (lambda url: ["--rows", "64", "--old-rows", "64", "--max-len", "2000", "--dp", "2",
                                  "--r3-rows", "32", "--layers", "4", "--project", "64"],
                     lambda out: len(_rows(out, "64 | before")) == 1 and len(_rows(out, "64 | after")) == 1
                     and _line(out, r"routing replay: per-rank batch GiB [0-9.]+ = [0-9.]+ x own")
                     and out.strip().splitlines()[-1].startswith("data path: per-rank GiB")),
    "data.py": (lambda url: ["--rows", "1000", "--chars", "40"], lambda out: len(_rows(out, "1,000")) == 1),
    # student: the tiny MoE on the module's server; teacher: the tiny dense Qwen3 (same tokenizer)
    "distill.py": (lambda url: ["--steps", "1", "--warm-start-steps", "0", "--student", _tiny_moe(),
                                "--teacher", str(tiny_model_dir("qwen3", 0)), "--student-url", url,
                                "--teacher-url", "{qwen3_url}", "--set", "eval.interval=0", *SMALL_STEP, "--out", "{tmp}"],
                   lambda out: "distill: accuracy first 5 steps" in out and "gspo: accuracy first 5 steps" in out),
    "gspo_vs_grpo.py": (lambda url: ["--steps", "1", "--set", f"rollout.server_urls=[{url}]",
                                     "--set", f"model.hf_path={_tiny_moe()}", "--set", "train.warm_start_steps=0",
                                     "--set", "eval.interval=0", *SMALL_STEP, "--out", "{tmp}"],
                        lambda out: "GSPO: mean reward of the last 1 steps" in out),
    "layouts.py": (lambda url: ["--layouts", "tp2", "--rows", "4", "--seq", "16", "--reps", "1"],
                   lambda out: _line(out, r"tp2\s+2\s+[0-9.]+")),
    "fp64_reference.py": (lambda url: ["--archs", "qwen3_moe"],
                          lambda out: len(_rows(out, "qwen3_moe |")) == 1),
    "logprobs_memory.py": (lambda url: ["--tokens", "128", "--vocab", "1024", "--hidden", "32"],
                           lambda out: _line(out, r"\s*1024\s+128 \|")),
    # the full model's rows on the session's server (its weights replaced: the module restores them);
    # the LoRA rows on a LoRA-enabled server of the benchmark's own
    "lora.py": (lambda url: ["--model", _tiny_moe(), "--full-url", url, "--rank", "4", "--steps", "1"],
                lambda out: len(_rows(out, "adapters, per_expert")) == 1 and len(_rows(out, "Qwen3-30B-A3B")) == 3
                and _line(out, r"lora: sync MB [0-9.]+ -> [0-9.]+, optimizer\+grad MB [0-9.]+ -> [0-9.]+, served = trainer yes")),
    "mfu.py": (lambda url: ["--rows", "4", "--reps", "1", "--only", "0"], lambda out: "|" in out),
    # the session's server serves the 2-layer 4-expert tiny MoE, without the engine's routes
    "moe_stability.py": (lambda url: ["--seeds", "1", "--steps", "3", "--runs", "gspo", "grpo", "--warm-start-steps",
                                      "0", "--layers", "2", "--experts", "4", "--url", url,
                                      "--set", "moe.engine_routing=false", "--set", "rollout.max_new_tokens=32",
                                      *SMALL_STEP, "--out", "{tmp}", "--plot", "--plot-dir", "{tmp}/img"],
                         lambda out: out.strip().splitlines()[-1].startswith("[bench] wrote")
                         and _line(out, r"stability: gspo [0-9.]+ ± [0-9.]+ \(\d/1 collapsed\); grpo ")),
    "rewards.py": (lambda url: ["--smoke"], lambda out: len(_rows(out, "math short")) == 1
                   and len(_rows(out, "code, 10 stdin tests")) == 1),
    # auto: gVisor where it runs (CI's machine), else the namespaces sandbox
    "sandbox_backends.py": (lambda url: ["--backends", "auto", "--runs", "2", "--groups", "1", "--group-size", "2"],
                            lambda out: len(_rows(out, "auto")) == 1 and "| exact |" in out),
    "rollout.py": (lambda url: ["--url", url, "--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1"],
                   lambda out: _line(out, r"\s+1\s+\d+\s+\d+\s+\d+")),
    # the session's server: its weights are replaced by the sync (the module restores them)
    "sync.py": (lambda url: ["--model", _tiny_moe(), "--url", url, "--repeats", "1", "--steps", "1",
                             "--lrs", "1e-6"],
                lambda out: len(_rows(out, "delta, all checked, lr 1e-06")) == 1
                and _line(out, r"sync: rank-0 GiB [0-9.]+ -> [0-9.]+, .* bit-identical yes$")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_prints_its_table_at_the_smallest_size(name, server_url, tmp_path, request):  # noqa: F811
    args, check = SMOKE[name]
    argv = args(server_url)
    if any("{qwen3_url}" in a for a in argv):
        qwen3_url = request.getfixturevalue("qwen3_server").server_urls[0]
        argv = [a.replace("{qwen3_url}", qwen3_url) for a in argv]
    out = _run([f"benchmarks/{name}", *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    assert check(out), out[-3000:]
