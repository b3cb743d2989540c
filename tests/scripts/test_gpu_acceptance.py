"""scripts/gpu_acceptance.sh on CPU: its dry run resolves every row of a GPU visit, puts each
command's arguments through the tool's own parser and imports every module of ours the tool reaches
(function-level imports too), so the script cannot rot between visits (a GPU comes by chance; a flag
renamed in between would cost a row of the visit), and the dry run names what rotted. The key
figures of the summary table are read from the tools' own tables. Bad options are one line."""
from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.sh"
ROWS = ["0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "2", "3", "4", "5"]


def acceptance(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "--root", str(ROOT), "--python", sys.executable, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def table_rows(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                          for line in stdout.splitlines() if re.match(r"\| \d", line))}


def test_dry_run_resolves_every_row_within_the_budget():
    out = acceptance(SCRIPT, "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PROBLEM" not in out.stdout
    rows = table_rows(out.stdout)
    assert list(rows) == ROWS
    # every family's local-spec row, then the TE rows (gpt-oss builds the local spec only)
    for rid, arch, spec in [("1.1", "qwen3_moe", "local"), ("1.2", "deepseek_v3", "local"), ("1.3", "gpt_oss", "local"),
                            ("1.4", "qwen3_next", "local"), ("1.5", "qwen3_moe", "te"), ("1.6", "deepseek_v3", "te"),
                            ("1.7", "qwen3_next", "te")]:
        assert f"scripts/gpu_check.sh --no-bench --arch {arch} --rows {spec} " in rows[rid][4], rows[rid]
    assert "--rows offload" in rows["1.8"][4]
    assert "tools/gpu_check_lora.py --out " in rows["1.9"][4] and rows["1.10"][1] == "not run"  # owed: no SGLang
    assert "benchmarks/mfu.py --device cuda --only 5 6 7" in rows["2"][4]
    assert "benchmarks/logprobs_memory.py --device cuda --dtype bf16" in rows["3"][4]
    assert "gspo_megatron.cli plan " in rows["4"][4] and rows["4"][4].endswith("--check`")
    assert "tools/gpu_check_sync.py" in rows["5"][4]  # the sync on one GPU, with the tiny models' rows
    assert re.search(r"parsed the arguments of 13 commands with their tools' own parsers; imported \d+ modules "
                     "of ours they reach", out.stdout), out.stdout
    # the rows 1.x and 5 share the machine: they cost their largest budget once
    budgets = {rid: int(cells[2]) for rid, cells in rows.items()}
    together = [rid for rid, cells in rows.items() if cells[1] == "rows 1.x and 5 at once"]
    assert together == [r for r in ROWS if r.startswith("1.") and r != "1.10"] + ["5"]  # 1.10 owed
    total = budgets["0"] + max(budgets[r] for r in together) + budgets["2"] + budgets["3"] + budgets["4"]
    cap = int(re.search(r"^BUDGET_CAP=(\d+)$", SCRIPT.read_text(), re.M).group(1))
    assert f"total: {total} s of device time (cap {cap} s" in out.stdout and total <= cap


@pytest.mark.parametrize("good, rotted, named", [
    ("--no-bench)", "--no-bnch)", "gpu_check.py: error: unrecognized arguments: --no-bnch"),
    ("qwen3_next:4", "qwen3_nxt:4", "argument --arch: invalid choice: 'qwen3_nxt'"),
    ("--only 5 6 7", "--only 4 6 7", "benchmarks/mfu.py --only 4: not a packed configuration"),
    ("--layout tensor=1", "--layuot tensor=1", "gspo-megatron: error: unrecognized arguments: --layuot"),
    ("--layout tensor=1 ", "--layout tensr=1 ", "--layout 'tensr=1': expected fields such as tensor=4"),
    ("examples/qwen3_235b_a22b.yaml", "examples/qwen3_235b.yaml", "'examples/qwen3_235b.yaml' does not exist"),
    ("row 2 mfu 100 ", "row 2 mfu 400 ", "the budgets add up to"),
])
def test_dry_run_names_what_rotted(tmp_path, good, rotted, named):
    text = SCRIPT.read_text()
    assert good in text
    copy = tmp_path / "gpu_acceptance.sh"
    copy.write_text(text.replace(good, rotted))
    out = acceptance(copy, "--dry-run", "--no-imports")  # the imports are the checkout's: the next test
    assert out.returncode == 1, out.stdout + out.stderr
    problems = [line for line in out.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert problems and all(named in p for p in problems), out.stdout
    assert out.stdout.rstrip().endswith("dry run: problems above")


def test_dry_run_imports_what_a_row_runs(tmp_path):
    """A function-level import that a move broke, in a tool a row runs only on a GPU: the dry run
    imports every module of ours the tool reaches and names the file, the line and the name."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("tools", ".git"):
            (checkout / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "tools", checkout / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    tool = checkout / "tools" / "gpu_check.py"
    moved = "    from gspo_megatron.actor.batching import packing\n"
    assert moved in tool.read_text()
    tool.write_text(tool.read_text().replace(moved, "    from gspo_megatron.actor import packing\n"))
    out = subprocess.run(["bash", str(SCRIPT), "--root", str(checkout), "--python", sys.executable, "--dry-run",
                          "--only", "1.5,2"], cwd=checkout, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    problems = [line for line in out.stdout.splitlines() if line.startswith("PROBLEM: ")]
    line = next(n for n, text in enumerate(tool.read_text().splitlines(), 1)
                if text == "    from gspo_megatron.actor import packing")
    assert problems == [f"PROBLEM: row 1.5: tools/gpu_check.py:{line}: from gspo_megatron.actor import packing: "
                        "gspo_megatron.actor has no 'packing'"], out.stdout


@pytest.mark.parametrize("scale", ["abc", "1e9", "0", "-1", "11", "2x"])
def test_a_bad_scale_is_one_line_naming_it_and_the_range(scale):
    out = acceptance(SCRIPT, "--dry-run", "--no-imports", "--scale", scale)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr == (f"gpu_acceptance: --scale {scale}: expected a number greater than 0 and at most 10 "
                          "(a budget's factor)\n")


def test_key_refuses_a_missing_log_or_an_unknown_kind(tmp_path):
    log = tmp_path / "1.1.log"
    out = acceptance(SCRIPT, "--key", "gpu_check", str(log))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"gpu_acceptance: --key gpu_check {log}: no such log file\n"
    log.write_text("a line\n")
    out = acceptance(SCRIPT, "--key", "gpu_chek", str(log))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("gpu_acceptance: --key gpu_chek: not a kind of row "
                          "(kinds: env gpu_check offload lora mfu logprobs plan sync)\n")
    assert acceptance(SCRIPT, "--key", "gpu_check", str(log)).stdout == "a line\n"  # no table: the last line


def test_dry_run_checks_that_out_is_writable(tmp_path):
    (tmp_path / "a_file").write_text("")
    for out_dir, why in [(tmp_path / "a_file" / "out", f"{tmp_path / 'a_file'} is not a folder"),
                         (Path("/proc/gspo_out/run1"), "/proc is a folder that refuses a new entry")]:
        out = acceptance(SCRIPT, "--dry-run", "--no-imports", "--out", str(out_dir))
        assert out.returncode == 1, out.stdout + out.stderr
        assert [line for line in out.stdout.splitlines() if line.startswith("PROBLEM")] == \
            [f"PROBLEM: --out {out_dir}: not writable ({why})"]
    fresh = tmp_path / "new" / "out"
    out = acceptance(SCRIPT, "--dry-run", "--no-imports", "--out", str(fresh))
    assert out.returncode == 0 and "PROBLEM" not in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "a_file"]  # the dry run made nothing


def test_only_takes_known_rows_in_row_order():
    out = acceptance(SCRIPT, "--dry-run", "--no-imports", "--only", "4,1.7 0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(table_rows(out.stdout)) == ["0", "1.7", "4"]
    out = acceptance(SCRIPT, "--dry-run", "--no-imports", "--only", "1.11")
    assert out.returncode == 2 and "--only: no row 1.11" in out.stderr


def test_key_figures_come_from_the_tools_tables(tmp_path):
    """The summary's key figure of a gpu_check row and of the offload row, read from what
    tools/gpu_check.py prints: a change of its table's layout shows here, not on the GPU."""
    from tools.gpu_check import table
    from tools.gpu_check_offload import describe
    common = dict(lp_mean=1e-7, loss=-0.3125, load_local=0.0, load_te=0.0, export=0.0, wgrad="TE 4/4 fused")
    rows = [dict(spec="local", dtype="fp32", tol=1e-4, lp_max=1.43e-6, ok=True, **common),
            dict(spec="te", dtype="bf16", tol=0.1, lp_max=2.94e-3, ok=False,
                 packed=dict(error="RuntimeError: no THD", ok=False), **common),
            dict(spec="conversion", dtype="fp32", untrained_export=0.0, ok=True)]
    log = tmp_path / "1.5.log"
    log.write_text("a warning\n\n" + table(rows) + "\n")
    key = acceptance(SCRIPT, "--key", "gpu_check", str(log)).stdout.strip()
    assert key == "PASS 2, FAIL 1 (te bf16); log-prob max diff local fp32 1.43e-06, te bf16 2.94e-03"
    offload = dict(loss_gpu=-0.3125, loss_host=-0.3124, weights_rel=1e-3, memory_saved=3 << 20,
                   adam_bytes=4 << 20, ok=True)
    log.write_text("table\n\n" + describe(offload) + "\n")
    key = acceptance(SCRIPT, "--key", "offload", str(log)).stdout.strip()
    assert key.startswith("step-2 loss -0.312500 on the GPU, -0.312400 offloaded;") and key.endswith(": ok")
    log.write_text('Traceback (most recent call last):\n  File "x.py"\ntorch.OutOfMemoryError: CUDA out of memory\n'
                   "[rank0]: destroy_process_group() was not called\n")
    key = acceptance(SCRIPT, "--key", "mfu", str(log)).stdout.strip()
    assert key == "torch.OutOfMemoryError: CUDA out of memory"  # the exception, not the last line


def test_key_figures_name_the_fp64_outlier_the_memory_after_close_and_a_skip(tmp_path):
    """gpu_check's newer lines reach the summary: the side off float64 where there is one, what
    holds the memory after close, and a family the start refuses (a SKIP, rc 0); the sync row's
    line (tools/gpu_check_sync.py's table)."""
    from tools.gpu_check import table
    from tools.gpu_check_memory import memory_key, memory_row
    common = dict(lp_mean=2e-4, loss=-0.3125, load_local=0.0, load_te=0.0, export=0.0, wgrad="-")
    fp64 = dict(ours=1.2e-6, transformers=8.9e-4, outlier="transformers", ok=True, why="")
    rows = [dict(spec="local", dtype="fp32", tol=1e-4, lp_max=8.94e-4, ok=True, fp64=fp64, **common)]
    memory = memory_row(0, [{"torch's cuBLAS workspaces": 96 << 20}], device="cpu")
    log = tmp_path / "1.3.log"
    log.write_text(table(rows) + f"\nmemory after close: {memory_key(memory)}\n")
    key = acceptance(SCRIPT, "--key", "gpu_check", str(log)).stdout.strip()
    assert key == ("PASS 1, FAIL 0; log-prob max diff local fp32 8.94e-04; local fp32 vs fp64: ours 1.20e-06, "
                   f"transformers 8.90e-04, outlier transformers; after close {memory_key(memory)}"), key
    assert "the closes freed torch's cuBLAS workspaces 96.0 MiB" in key
    line = "Gated DeltaNet layers (Qwen3-Next) on NVIDIA H200 (compute capability 9.0) with Triton 3.6.0: ..."
    log.write_text(table([dict(spec="te", dtype="fp32, bf16", skip=line, ok=True)]) + "\n")
    assert acceptance(SCRIPT, "--key", "gpu_check", str(log)).stdout.strip() == f"SKIP: {line}"
    log.write_text("| full | ... |\n\nsync on one device (NVIDIA H200, CUDA IPC): full 0.429 MB in 0.1 s, delta "
                   "0.320 MB in 0.1 s; bit-identical yes; control caught yes\n")
    assert acceptance(SCRIPT, "--key", "sync", str(log)).stdout.strip() == (
        "(NVIDIA H200, CUDA IPC): full 0.429 MB in 0.1 s, delta 0.320 MB in 0.1 s; bit-identical yes; "
        "control caught yes")


def test_a_run_records_every_row_and_reruns_the_failed(tmp_path):
    """On CPU the GPU rows fail (no CUDA device, or their budget cut to a second runs out): each
    still gets its row, the run goes on and exits 1, and `--only failed` picks exactly those rows."""
    env_tmp = {"TMPDIR": str(tmp_path)}  # the script's record of the last run lives there

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", **env_tmp})
    out = run("--out", str(tmp_path / "out"), "--only", "5,1.8,1.1", "--scale", "0.001")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = table_rows((tmp_path / "out" / "summary.md").read_text())
    assert list(rows) == ["1.1", "1.8", "5"]
    for rid, tool in (("1.1", "bash scripts/gpu_check.sh --no-bench --arch qwen3_moe --rows "),
                      ("1.8", "bash scripts/gpu_check.sh --no-bench --arch qwen3_moe --rows "),
                      ("5", f"{sys.executable} tools/gpu_check_sync.py")):
        step, _, command, rc, seconds, budget, key = rows[rid]
        assert command.startswith(f"`{tool}") and budget == "1", rows[rid]
        assert (rc == "timeout" and key.startswith("ran out of its 1 s")) or \
            (rc == "2" and key.endswith(": no CUDA device (use --cpu-smoke for the CPU steps)")) or \
            (rc == "2" and key.endswith(": no CUDA device (use --cpu for the same path on the host)")), rows[rid]
    # what comes back of a device call: at most 8 files, every log and row inside the archive
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["logs.tar.gz", "summary.md", "summary.tsv", "summary_all.md", "summary_all.tsv"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as archive:
        names = sorted(archive.getnames())
    assert {f"logs/{r}.log" for r in rows} | {f"rows/{r}.tsv" for r in rows} <= set(names), names
    assert out.stdout.index("| 1.1 |") < out.stdout.index("--- 1.1 (")  # the table, then the failures' ends
    again = run("--dry-run", "--no-imports", "--only", "failed")
    assert again.returncode == 0 and list(table_rows(again.stdout)) == ["1.1", "1.8", "5"], again.stdout
