"""End to end: `gspo-megatron train` as a user runs it (torchrun, a real SGLang server on CPU, the
tiny MoE), 2-3 steps under a parallel layout; and the clear one-line errors of the CLI.

The server is the session's shared `moe_server` (tests/fixtures_servers.py), attached by URL as a
cluster run would: each run syncs its initial policy into it first, and the module restores the
seed-0 weights at the end, as fixtures_servers asks.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_models import tiny_model_dir, warm_tiny_moe_dir

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "data" / "larger_digit.jsonl"


def base_overrides(run_dir: Path, server_url: str, **extra) -> list[str]:
    sets = {
        # the example's warm start done once (fixtures_models.warm_tiny_moe_dir), not in every run
        "model.hf_path": str(warm_tiny_moe_dir()), "train.warm_start_steps": 0,
        "rollout.prompts": str(PROMPTS), "rollout.reward": "exact_match",
        "rollout.server_urls": f"[{server_url}]", "rollout.group_size": 4,
        "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
        "train.steps": 3, "train.mini_batches": 2, "train.micro_batch_size": 4, "train.lr": 1e-3,
        "checkpoint.dir": str(run_dir / "ckpt"), "checkpoint.interval": 1,
        "logging.tensorboard_dir": str(run_dir / "tb"), "logging.progress": True,
        "eval.interval": 0,  # the example's held-out eval: only where a test asks for it
        "checkpoint.export_hf": "null",  # the example's export folder is in the repository's runs/
        **extra}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def train_cmd(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "gspo_megatron.cli", "train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "gspo_megatron.cli", "train"]


def env() -> dict[str, str]:
    # tests/ on the path too: runs may name the tests' own reward functions (prompt_rewards.py)
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def run_train(args: list[str], nproc: int = 1, timeout: float = 600, **kw):
    return subprocess.run(train_cmd(nproc) + args, cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def server_url(moe_server):
    yield moe_server.server_urls[0]
    from rollout.servers.client import SGLangClient
    SGLangClient(moe_server.server_urls[0]).update_weights_from_disk(
        str(tiny_model_dir("qwen3_moe", 0)), weight_version="seed0")


def _check_run(run_dir: Path, steps: int) -> None:
    from gspo_megatron.run.metrics import read_jsonl, read_scalars
    recs = read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)
    assert [r["step"] for r in recs] == list(range(steps))
    scalars = read_scalars(run_dir / "tb")
    for tag in ("rollout/reward_mean", "rollout/reward_std", "rollout/accuracy",
                "rollout/response_length_mean", "rollout/response_length_max",
                "rollout/groups_dropped", "rollout/partial_buffered", "train/clip_fraction",
                "train/seq_ratio_mean", "train/seq_ratio_min", "train/seq_ratio_max",
                "train/grad_norm", "train/lr", "train/entropy", "train/logprob_abs_diff",
                "perf/tokens_per_s", "time/rollout", "time/log_probs", "time/train", "time/sync"):
        assert [s for s, _ in scalars[tag]] == list(range(steps)), tag
    from gspo_megatron.run.metrics import documented
    assert all(documented(t) for t in scalars), [t for t in scalars if not documented(t)]
    # The tiny MoE's routing drift (moe.drift is on by default for MoE models), per layer too.
    assert [s for s, _ in scalars["routing/drift"]] == list(range(steps))
    assert "routing_layers/drift_layer_0" in scalars
    assert all(v > 0 for _, v in scalars["perf/sync_gb_per_s"])
    # Trainer and SGLang on the same weights (fp32, CPU): log-probs agree closely.
    assert all(v < 1e-3 for _, v in scalars["train/logprob_abs_diff"])
    assert (run_dir / "ckpt" / "latest").read_text().strip() == f"step_{steps:08d}"


@pytest.mark.slow
def test_train_tp2_end_to_end(tmp_path, server_url):
    proc = run_train(["examples/tiny_moe_larger_digit.yaml", *base_overrides(
        tmp_path, server_url, **{"parallel.tensor": 2, "checkpoint.export_hf": str(tmp_path / "hf"),
                                 "loss.kl_coef": 0.01})],
        nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "layout TP2xPP1xEP1xETP2xDP1 on 2 rank(s)" in proc.stdout
    assert "loss=gspo eps_low=0.0003 eps_high=0.0004" in proc.stdout
    assert proc.stdout.count("step ") >= 3
    _check_run(tmp_path, 3)
    # KL penalty on: reference log-probs each step, the reference saved once for resumes.
    from gspo_megatron.run.metrics import read_scalars
    scalars = read_scalars(tmp_path / "tb")
    kl = [v for _, v in scalars["train/kl"]]
    assert len(kl) == 3 and all(v >= 0 for v in kl) and len(scalars["time/ref_log_probs"]) == 3
    assert (tmp_path / "ckpt" / "reference" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "config.json").is_file()
    assert list((tmp_path / "hf").glob("*.safetensors"))


# --- clear errors ----------------------------------------------------------------------------------
def _error_line(proc, code: int = 2) -> str:
    """The one error line of a run that failed with exit `code` (2: the inputs, 3: a runtime stop)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("gspo-megatron: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_clear_errors_before_start(tmp_path, capsys):
    """Config and file errors: caught before anything starts (in-process, fast)."""
    from gspo_megatron.cli import main
    cfg = "examples/tiny_moe_larger_digit.yaml"
    hf = str(tiny_model_dir("qwen3_moe", 0))

    def error(argv: list[str]) -> str:
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        return lines[0]
    assert "unknown key 'train.stepz' (did you mean 'steps'?)" in error([cfg, "--set", "train.stepz=3"])
    assert "nope.yaml' does not exist" in error([str(tmp_path / "nope.yaml")])
    assert "train.lr='fast': expected float" in error([cfg, "--set", "train.lr=fast"])
    assert "model.hf_path='/nonexistent/model': no config.json" in error(
        [cfg, "--set", "model.hf_path=/nonexistent/model"])
    assert "rollout.prompts: '/nonexistent.jsonl': no such file or folder" in error(
        [cfg, "--set", f"model.hf_path={hf}", "--set", "rollout.prompts=/nonexistent.jsonl"])


@pytest.mark.slow
def test_clear_errors_at_start(tmp_path):
    """Errors found once the run starts (bad prompt record, unreachable server, impossible
    layout): one line, no traceback; exit 2 for the inputs, 3 for the server that is not there."""
    from rollout.servers.launch import free_port
    hf = str(tiny_model_dir("qwen3_moe", 0))
    args = ["examples/tiny_moe_larger_digit.yaml", "--set", f"model.hf_path={hf}",
            "--set", f"checkpoint.dir={tmp_path / 'ck'}",
            "--set", f"logging.tensorboard_dir={tmp_path / 'tb'}",
            "--set", f"rollout.server_urls=[http://127.0.0.1:{free_port()}]",
            "--set", "rollout.server_startup_timeout_s=3"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "answer": "1"}\n{"prompt": "x"}\n')
    line = _error_line(run_train(args + ["--set", f"rollout.prompts={bad}"], timeout=300))
    assert f"rollout.prompts: {bad}:2: no key 'answer' (no 'answer'; the row has ['prompt'])" in line
    line = _error_line(run_train(args, timeout=300), code=3)
    assert "no healthy SGLang server at http://127.0.0.1:" in line
    line = _error_line(run_train(args + ["--set", "parallel.tensor=3"], timeout=300))
    assert "is not divisible by tensor 3" in line
