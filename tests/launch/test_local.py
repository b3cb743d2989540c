"""launch/local.sh: servers + torchrun on one machine, then the same command again resumes.

One run is the real thing (gspo-megatron train, TP2 under torchrun, a real SGLang server started by
the script, stopped at the end); a run and the rerun that resumes use the launch tests' stand-ins
(see test_slurm.py) to check the script's own bookkeeping quickly: a real torch.distributed all-reduce with atomic per-step
checkpoints, and a /health server.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port
from fixtures_models import tiny_model_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def test_local_run_then_rerun_resumes_from_latest(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "toy.yaml"
    config.write_text("toy:\n  steps: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GSPO_", "SLURM_"))}
    env.update(GSPO_TRAIN_CMD=f"{PY} {ROOT}/tests/launch_toy_trainer.py train",
               GSPO_SERVER_CMD=f"{PY} {ROOT}/tests/launch_toy_server.py", GSPO_PYTHON=PY,
               GSPO_SERVER_PORT=str(free_port()))
    cmd = ["bash", str(ROOT / "launch/local.sh"), "--gpus", "0", "--procs", "2", "--model-path", str(model),
           "--run-dir", str(tmp_path / "run"), str(config)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "starting fresh" in first.stdout  # rank 0 is echoed to the console
    second = subprocess.run([*cmd, "--set", "toy.steps=3"], capture_output=True, text=True, timeout=180, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming after step 1" in second.stdout

    ckpt = tmp_path / "run" / "checkpoints"
    state = json.loads((ckpt / (ckpt / "latest").read_text().strip()).read_text())
    assert [h["step"] for h in state["history"]] == [1, 2, 3]
    assert [h["value"] for h in state["history"]] == [3.0, 6.0, 9.0]
    port = int(env["GSPO_SERVER_PORT"])
    assert state["history"][0]["servers"] == [f"http://127.0.0.1:{port}"]
    runs = sorted((tmp_path / "run" / "logs").iterdir())
    assert len(runs) >= 1
    names = sorted(p.name for p in runs[-1].iterdir())
    host = socket.gethostname().split(".")[0]  # what `hostname -s` prints
    assert names == [f"server-{host}-s0.log", f"trainer-{host}-r0.log", f"trainer-{host}-r1.log"]
    assert "SIGTERM, stopping" in (runs[-1] / f"server-{host}-s0.log").read_text()  # stopped at the end


def test_local_real_trainer_and_server(tmp_path):
    """local.sh starts a real SGLang server and a TP2 trainer that trains against it, and stops the
    server at the end. (The rerun that resumes through local.sh is the stand-ins' test above; the
    real trainer's resume is tests/trainer/test_trainer_resume.py's.)"""
    from gspo_megatron.run.metrics import read_jsonl
    model, run_dir = tiny_model_dir("qwen3_moe", 0), tmp_path / "run"
    sets = {"model.hf_path": model, "parallel.tensor": 2, "rollout.group_size": 4,
            "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6, "train.steps": 2,
            "train.mini_batches": 2, "train.micro_batch_size": 4, "train.warm_start_steps": 0,
            "checkpoint.interval": 1, "checkpoint.export_hf": "null",
            "logging.tensorboard_dir": run_dir / "tb", "eval.interval": 0}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GSPO_", "SLURM_"))}
    env.update(GSPO_PYTHON=PY, GSPO_SERVER_PORT=str(free_port()))
    cmd = ["bash", str(ROOT / "launch/local.sh"), "--gpus", "0", "--procs", "2", "--model-path", str(model),
           "--run-dir", str(run_dir), str(ROOT / "examples/tiny_moe_larger_digit.yaml"),
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert "layout TP2" in first.stdout and "resumed from" not in first.stdout
    assert [r["step"] for r in read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)] == [0, 1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    host = socket.gethostname().split(".")[0]
    (logs,) = sorted((run_dir / "logs").iterdir())
    names = sorted(p.name for p in logs.iterdir())
    assert names == [f"server-{host}-s0.log", f"trainer-{host}-r0.log", f"trainer-{host}-r1.log"]
    assert "rollout.servers.launch:" in (logs / f"server-{host}-s0.log").read_text()
    with pytest.raises(ConnectionRefusedError):  # the script stopped the server: no one listens
        socket.create_connection(("127.0.0.1", int(env["GSPO_SERVER_PORT"])), timeout=5).close()
