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
    # both sides against transformers in float64 (tools/gpu_check_reference.py): neither off on CPU
    assert "; fp64: ours " in rows[0] and ", outlier none |" in rows[0], rows[0]
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


@pytest.fixture(scope="module")
def gpt_oss_references(tmp_path_factory):
    """transformers' log-probs of the tiny gpt-oss (gpu_check's batch) in fp32 and float64 on CPU."""
    import torch

    from tools.gpu_check import _batch
    from tools.gpu_check_reference import fp64_log_probs, hf_log_probs
    from tools.make_tiny_model import make_tiny_model
    hf_dir = make_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "hf", seed=0)
    batch = _batch(512, seq=32)
    exact, why = fp64_log_probs(hf_dir, batch, "cpu")
    assert exact is not None and why == "", why
    return hf_log_probs(hf_dir, batch, torch.float32, "cpu"), exact, batch.loss_mask


def test_the_fp64_comparison_names_the_side_that_is_off(gpt_oss_references):
    """What the GPU row concludes where ours and transformers differ (gpt-oss: 8.9e-4 on an H200):
    the side beyond the tolerance of float64 is the outlier, and the row passes when it is
    transformers. Here transformers' own fp32 log-probs play both sides, one of them moved by
    2e-3 at one position, the difference the row must attribute."""
    from tools.gpu_check_reference import against_fp64, fp64_cell
    fp32, exact, mask = gpt_oss_references
    moved = fp32.clone()
    moved[mask.nonzero()[5].tolist()[0], mask.nonzero()[5].tolist()[1]] += 2e-3
    tol = 1e-4
    same = against_fp64(fp32, fp32, exact, mask, tol)
    assert same["outlier"] == "none" and same["ok"] and same["ours"] < 1e-6, same
    ours_off = against_fp64(moved, fp32, exact, mask, tol)
    assert ours_off["outlier"] == "ours" and ours_off["ok"] is False and ours_off["ours"] > 1.9e-3, ours_off
    theirs_off = against_fp64(fp32, moved, exact, mask, tol)
    assert theirs_off["outlier"] == "transformers" and theirs_off["ok"] is True, theirs_off
    assert against_fp64(moved, moved, exact, mask, tol)["outlier"] == "both"
    cell = fp64_cell(dict(theirs_off, transformers_eager_experts=1.5e-7))
    assert cell == (f"; fp64: ours {theirs_off['ours']:.2e}, transformers {theirs_off['transformers']:.2e} "
                    "(eager experts 1.50e-07), outlier transformers"), cell
    cell = fp64_cell(dict(ours_off, flips={"without TE's fused RoPE and MoE permutation": 3e-7}))
    assert cell.endswith(", outlier ours; ours without TE's fused RoPE and MoE permutation: 3.00e-07"), cell
    none = against_fp64(fp32, fp32, None, mask, tol, why="RuntimeError: no float64 kernel")
    assert none["ok"] is None and fp64_cell(none) == "; fp64: - (RuntimeError: no float64 kernel)"


def test_the_memory_row_says_what_holds_the_bytes_left():
    """The 'every Actor closed' row's breakdown (tools/gpu_check_memory.py) on the host's tensors:
    a tensor left alive is named by shape and bytes, what the closes freed is summed per holder."""
    import torch

    from tools.gpu_check_memory import MIB, memory_cell, memory_key, memory_row
    left = torch.empty(16 * MIB, dtype=torch.uint8)
    released = [{"torch's cuBLAS workspaces": 32 * MIB, "megatron's RNG tracker": 0},
                {"torch's cuBLAS workspaces": 64 * MIB, "Transformer Engine's workspaces": 128 * MIB}]
    row = memory_row(0, released, device="cpu")
    assert row["largest"][0] == (16 * MIB, f"({16 * MIB},) uint8") and row["tensor_bytes"] >= 16 * MIB
    assert row["freed"] == {"torch's cuBLAS workspaces": 96 * MIB, "megatron's RNG tracker": 0,
                            "Transformer Engine's workspaces": 128 * MIB}
    assert memory_cell(row).endswith("the closes freed: Transformer Engine's workspaces 128.0 MiB, "
                                     "torch's cuBLAS workspaces 96.0 MiB")
    assert memory_key(row).startswith("0.0 MiB (tensors ") and "RNG" not in memory_key(row)
    del left


@pytest.mark.parametrize("profile", ["cpu", "cuda", "cuda+te", "cuda+te+apex"])
def test_a_family_the_start_would_refuse_is_one_skip_row(profile):
    """Qwen3-Next on an H200 with Triton 3.6.0, each machine profile faked: gpu_check prints one
    SKIP row with the start check's line where the profile has CUDA, and checks it elsewhere."""
    import dataclasses

    from test_settings_machine_profiles import PROFILES
    from tools.gpu_check import refusal, table
    available = dataclasses.replace(PROFILES[profile], gpu_name="NVIDIA H200", gpu_capability=(9, 0),
                                    triton_version="3.6.0")
    assert refusal("qwen3_moe", available) is None
    line = refusal("qwen3_next", available)
    assert (line is not None) == available.cuda
    if line is not None:
        row = table([dict(spec="te", dtype="fp32, bf16", skip=line, ok=True)]).splitlines()[-1]
        assert row == f"| te | fp32, bf16 | - | - | - | - | - | - | SKIP: {line} |"


def _flipped(rank, world, hf_dir, mcore):
    import torch

    from tools.gpu_check import _batch
    from tools.gpu_check_reference import fp64_log_probs, ours_flipped
    batch = _batch(512, seq=32)
    exact, _ = fp64_log_probs(Path(hf_dir), batch, "cpu")
    return ours_flipped(Path(hf_dir), Path(mcore), batch, exact, batch.loss_mask, torch.float32)


@pytest.mark.slow
def test_ours_runs_with_each_cuda_only_path_off(tmp_path):
    """The GPU row's diagnostic where ours is the side off float64 (tools/gpu_check_reference.py
    flips()): each flip builds and runs on CPU, where none of those paths runs anyway, so each stays
    as close to float64 as ours does (a flip that broke the model would not)."""
    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from tools.gpu_check_reference import flips
    from tools.make_tiny_model import make_tiny_model
    hf_dir = make_tiny_model("gpt_oss", tmp_path / "hf", seed=0)
    mcore = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    got = run_distributed(_flipped, 1, args=(str(hf_dir), str(mcore)), timeout=900)[0]
    assert list(got) == list(flips()), got
    assert all(isinstance(v, float) and v < 2e-6 for v in got.values()), got
