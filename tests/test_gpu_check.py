"""scripts/gpu_check.sh's steps on the CPU (tools/gpu_check.py --cpu-smoke: local spec, fp32), so
that the GPU acceptance run does not rot between GPU visits. On CPU this proves the script and the
local spec only; the TE rows exist only on a GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| local") or ln.startswith("| HF")]
    assert len(rows) == 2 and all(r.endswith("| PASS |") for r in rows), proc.stdout[-2000:]
    assert "| local | fp32 | " in rows[0] and "| - | -0.3125 |" in rows[0]  # on-policy: -mean(A)
