"""scripts/gpu/: the GPU visit's set-up, checked on CPU without downloading its 300 MB. The scripts
parse; prepare.sh's dry run names what it would fetch and every device call's load, and refuses a
part size that would put a call over the device tool's 64 MiB; a file cut into parts and put back
together is the same file, its checksum checked, a missing, foreign or damaged part named; the
folders the parts travel in are git-ignored (a carried folder must be, and the working tree must
not hold 300 MB); nothing points at set-up scripts outside the repository."""
from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # a dry run that fetched would fail


def bash(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **OFFLINE, **(env or {})})


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_the_scripts_parse(script):
    out = bash("-n", str(GPU / script))
    assert out.returncode == 0, out.stderr


def test_prepare_dry_run_lists_what_it_fetches_and_the_part_layout():
    out = bash(str(GPU / "prepare.sh"), "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    for wanted in ("megatron-core==0.19.2", "flash-linear-attention==0.6.0", "transformer-engine==2.20.2",
                   "transformer-engine-torch==2.20.2 (source", "transformer-engine-cu13==2.20.2"):
        assert wanted in out.stdout, wanted
    calls = re.findall(r"^  call (\d): \.gpu_p(\d) \(part\.0(\d), ([\d.]+) MiB\)(.*) = ([\d.]+) MiB of 64$",
                       out.stdout, re.M)
    assert [(c[0], c[1], c[2]) for c in calls] == [(str(k + 1), str(k), str(k)) for k in range(5)], out.stdout
    assert all(float(c[3]) == 58.0 for c in calls[:4]) and 0 < float(calls[4][3]) < 58
    assert ".gpu (" in calls[4][4] and all(".gpu (" not in c[4] for c in calls[:4])  # .gpu/ with the last part
    assert all(float(c[5]) <= 64 for c in calls)
    assert out.stdout.rstrip().endswith("dry run: nothing fetched")
    assert "megatron-core==0.16.1" in bash(str(GPU / "prepare.sh"), "--dry-run", env={"MCORE": "0.16.1"}).stdout


def test_prepare_refuses_a_part_size_that_overfills_a_call():
    out = bash(str(GPU / "prepare.sh"), "--dry-run", env={"PART_MIB": "62"})
    assert out.returncode == 1
    assert out.stdout.count("PROBLEM: over the limit") == 4, out.stdout  # the last part is smaller
    assert out.stdout.rstrip().endswith("dry run: a call is over 64 MiB: lower PART_MIB")
    bad = bash(str(GPU / "prepare.sh"), "--dry-run", env={"PART_MIB": "5x"})
    assert (bad.returncode, bad.stderr) == (1, "prepare: PART_MIB=5x: expected a whole number of MiB\n")


def test_split_and_join_give_back_the_file(tmp_path):
    """The device's way: one part folder arrives per call, the parts pile up in one folder, and
    the file is put back together once all have come."""
    wheel = tmp_path / "transformer_engine_cu13-9.9-py3-none-any.whl"
    wheel.write_bytes(random.Random(0).randbytes(3 * 2**20 + 12345))  # 3 MiB and a bit: 4 parts of 1 MiB
    here, device = tmp_path / "here", tmp_path / "device"
    here.mkdir()
    split = bash(str(GPU / "parts.sh"), "split", str(wheel), "1", str(here / ".gpu_p"))
    assert (split.returncode, split.stdout) == (0, "4\n"), split.stderr
    assert sorted(p.name for p in here.iterdir()) == [f".gpu_p{k}" for k in range(4)]
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    for k in range(4):
        folder = here / f".gpu_p{k}"
        assert sorted(p.name for p in folder.iterdir()) == ["NAME", "PARTS", "SHA256", f"part.0{k}"]
        assert (folder / "SHA256").read_text() == sha + "\n" and (folder / "NAME").read_text() == wheel.name + "\n"
    assert sum((here / f".gpu_p{k}" / f"part.0{k}").stat().st_size for k in range(4)) == wheel.stat().st_size

    def call(*parts: int) -> subprocess.CompletedProcess:  # one device call carrying these parts
        carried = tmp_path / "call"
        shutil.rmtree(carried, ignore_errors=True)
        carried.mkdir()
        for k in parts:
            shutil.copytree(here / f".gpu_p{k}", carried / f".gpu_p{k}")
        return bash(str(GPU / "parts.sh"), "collect", str(device), ".gpu_p", cwd=carried)

    assert call(0).stdout == f"parts: 1 folder(s) collected into {device}; parts still to come: 1 2 3 (of 0-3)\n"
    assert call(2).stdout.endswith("parts still to come: 1 3 (of 0-3)\n")
    early = bash(str(GPU / "parts.sh"), "join", str(device), str(tmp_path / "out"))
    assert (early.returncode, early.stderr) == (1, f"parts: join: {device}: parts still to come: 1 3 (of 0-3)\n")
    assert call(1, 3).stdout.endswith("all 4 parts here\n")
    joined = bash(str(GPU / "parts.sh"), "join", str(device), str(tmp_path / "out"))
    assert joined.returncode == 0 and joined.stdout == f"{tmp_path / 'out' / wheel.name}\n", joined.stderr
    assert (tmp_path / "out" / wheel.name).read_bytes() == wheel.read_bytes()

    # a damaged part: the checksum names it, and nothing half-right is left behind
    part = device / "part.02"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    damaged = bash(str(GPU / "parts.sh"), "join", str(device), str(tmp_path / "out2"))
    assert damaged.returncode == 1 and damaged.stderr.startswith(f"parts: join: {wheel.name}: checksum ")
    assert damaged.stderr.endswith(f", expected {sha}\n") and not (tmp_path / "out2" / wheel.name).exists()

    # a part of another file does not mix with these
    other = tmp_path / "other.whl"
    other.write_bytes(b"x" * 100)
    assert bash(str(GPU / "parts.sh"), "split", str(other), "1", str(here / ".gpu_p")).stdout == "1\n"
    assert [p.name for p in here.iterdir()] == [".gpu_p0"]  # the earlier file's parts are gone
    mixed = call(0)
    assert mixed.returncode == 1 and "holds a part of other.whl" in mixed.stderr, mixed.stderr


def test_the_part_folders_are_git_ignored():
    folders = [".gpu", *(f".gpu_p{k}" for k in range(5))]
    paths = [p for f in folders for p in (f"{f}/", f"{f}/part.00")]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == paths, out.stdout + out.stderr


def test_nothing_points_at_set_up_scripts_outside_the_repository():
    out = subprocess.run(["git", "grep", "--untracked", "-n", "-e", "shared/gpu", "-e", "prepare_wheels", "-e",
                          "stage_part", "--", ".", f":!{Path(__file__).relative_to(ROOT)}"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", out.stdout
