"""launch/local.sh: servers + torchrun on one machine, then the same command again resumes.

The trainer and server commands are the launch tests' stand-ins (see test_launch_slurm.py): a real
torch.distributed all-reduce with atomic per-step checkpoints, and a /health server.
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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
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
