"""The GPU acceptance run's LoRA row (scripts/gpu_acceptance.sh 1.9, tools/gpu_check_lora.py): the
key figure the script reads from the tool's table, passing and failing. (The tool's flags and
imports are the dry run's: tests/scripts/test_gpu_acceptance.py; its local-spec path runs on CPU
with --cpu-smoke.)"""
from __future__ import annotations

import subprocess

from test_trainer_e2e import ROOT

TABLE = """
| spec | check | max diff | result |
|---|---|---|---|
| local | B = 0 is the base, bit for bit | 0 | PASS |
| local | adapters = merged dense policy (log-probs) | 9.54e-07 | PASS |
| te | B = 0 is the base, bit for bit | 0 | PASS |
| te | adapter gradients = local spec's (relative) | 0.0031 | FAIL |
"""


def test_the_acceptance_script_reads_the_tools_table(tmp_path):
    log = tmp_path / "1.9.log"
    log.write_text("[rank0] noise before the table\n" + TABLE)
    key = subprocess.run(["bash", "scripts/gpu_acceptance.sh", "--key", "lora", str(log)], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=60)
    assert key.stdout.startswith("PASS 3, FAIL 1 ( te adapter gradients = local spec's (relative) );"), key.stdout
    assert "te 0.0031" in key.stdout
