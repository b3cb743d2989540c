"""scripts/gpu_check.sh's steps on the CPU (tools/gpu_check.py --cpu-smoke: local spec, fp32), so
that the GPU acceptance run does not rot between GPU visits. On CPU this proves the script and the
local spec only; the TE rows exist only on a GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_gpu_check_cpu_smoke(tmp_path, arch):
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path),
                           "--arch", arch],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| local") or ln.startswith("| HF")]
    assert len(rows) == 2 and all(r.endswith("| PASS |") for r in rows), proc.stdout[-2000:]
    assert "| local | fp32 | " in rows[0] and "| - | -0.3125 |" in rows[0]  # on-policy: -mean(A)
    # Where the weight-gradient accumulation is fused: nowhere on a CPU (no TE, no apex).
    assert "| megatron's own (" in rows[0] and " 0/" in rows[0].split("megatron's own")[1], rows[0]


def test_context_parallel_row_compares_and_skips():
    """The CP row's comparison and table on made-up runs (the runs themselves need 2 GPUs)."""
    import torch

    from tools.gpu_check_cp import compare, cp_row, table
    mask = torch.tensor([[False, True, True], [False, True, False]])
    lp = -torch.rand(2, 3)
    run = dict(lp=lp, after=lp + 0.05, loss=-0.3125, grad_norm=2.0, num_sequences=2.0, tokens=3.0,
               layout="TP1xPP1xEP1xETP1xDP1")
    close = dict(run, lp=lp + 1e-3, after=lp + 0.051, grad_norm=2.02, layout="TP1xPP1xCP2xEP1xETP1xDP1")
    row = compare(run, close, mask)
    assert row["ok"] and "| PASS |" in table(row)
    assert not compare(run, dict(close, num_sequences=4.0), mask)["ok"]  # counted per CP rank
    assert not compare(run, dict(close, grad_norm=4.0), mask)["ok"]
    assert not compare(run, dict(close, lp=lp + 0.5), mask)["ok"]
    assert not compare(run, close, mask, tol=1e-4)["ok"]  # the packed row's fp32 tolerance
    skip = cp_row(Path("/nonexistent"), Path("."), Path("."), None)  # no CUDA here
    assert skip["ok"] and "SKIP: needs 2 GPUs, found 0" in table(skip)


def test_packed_row_control_and_cell():
    """The packed-vs-padded row's pieces that do not need TE: the one-segment control joins every
    row (and the padding) into one attention segment, and the cell shows a failure's reason."""
    import torch

    from gspo_megatron.actor.batching.packing import pack
    from tools.gpu_check import _one_segment, _packed_cell
    packed = pack(torch.arange(20).reshape(2, 10), torch.tensor([10, 7]), multiple=8)
    assert packed.cu_seqlens.tolist() == [0, 10, 17, 24]
    control = _one_segment(packed).seq_params()
    assert control.cu_seqlens_q.tolist() == [0, 24] and control.cu_seqlens_q.dtype == torch.int32
    assert control.max_seqlen_q == 24 and control.qkv_format == "thd"
    assert _packed_cell(dict(error="RuntimeError: no backend", ok=False)) == "FAIL: RuntimeError: no backend"
    cell = _packed_cell(dict(lp_max=1e-6, after_max=2e-6, grad_norm=(2.0, 2.01), leak=0.17, ok=True))
    assert cell == "1.0e-06, after step 2.0e-06, grad norm 2.01 vs 2; one-segment control 0.17"
