"""tools/gpu_check_lora.py, the GPU acceptance run's LoRA row (scripts/gpu_acceptance.sh 1.9), on
CPU: its own path with the local spec (the TE rows need a GPU), and the key figure the acceptance
script reads from its table."""
from __future__ import annotations

import subprocess
import sys

import pytest

from test_trainer_e2e import ROOT, env


@pytest.mark.slow
def test_cpu_smoke_passes_and_the_acceptance_script_reads_it(tmp_path):
    run = subprocess.run([sys.executable, "tools/gpu_check_lora.py", "--cpu-smoke", "--out", str(tmp_path / "w")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "| local | B = 0 is the base, bit for bit | 0 | PASS |" in run.stdout
    log = tmp_path / "1.9.log"
    log.write_text(run.stdout)
    key = subprocess.run(["bash", "scripts/gpu_acceptance.sh", "--key", "lora", str(log)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert key.stdout.startswith("PASS 2, FAIL 0; diffs local 0"), key.stdout + key.stderr
