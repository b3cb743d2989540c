"""The venv builds stop at once, with one clear line, when the disk cannot hold the venv
(scripts/setup_lib.sh: need_disk). Without the check, a full disk shows up minutes into the build
as pip's "[Errno 28] No space left on device" and leaves a half-built venv behind."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "scripts" / "setup_lib.sh"


def need_disk(venv: Path, gib: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'source "{LIB}"; need_disk setup "{venv}" {gib}; echo passed'],
                          capture_output=True, text=True, timeout=30)


def free_gib(path: Path) -> int:
    return shutil.disk_usage(path).free // 2**30


def test_refuses_a_fresh_build_that_does_not_fit(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    too_much = free_gib(tmp_path) + 1000
    out = need_disk(venv, too_much)
    assert out.returncode == 1 and "passed" not in out.stdout
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"not enough disk for {venv}" in line and f"needs about {too_much} GiB" in line
    assert f"{free_gib(tmp_path)} GiB free" in line or f"{free_gib(tmp_path) - 1} GiB free" in line
    assert not venv.exists()


def test_lets_a_build_that_fits_go_on(tmp_path: Path) -> None:
    out = need_disk(tmp_path / ".venv", 0)
    assert out.returncode == 0 and out.stdout.strip() == "passed", out.stderr


def test_an_existing_venv_only_needs_room_for_an_update(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    python = shutil.which("python3")
    assert python is not None
    (venv / "bin" / "python").symlink_to(python)
    out = need_disk(venv, free_gib(tmp_path) + 1000)
    assert out.returncode == 0, out.stderr  # 2 GiB asked, not the fresh build's figure


def test_both_setup_scripts_check_before_pip_runs() -> None:
    for name in ("setup.sh", "setup_mcore019.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert text.index("need_disk ") < text.index(' -m venv "$VENV"') < text.index('quiet "${PIP[@]}" install'), name


def test_a_venv_in_a_folder_not_yet_made_is_measured_where_it_will_be(tmp_path: Path) -> None:
    venv = tmp_path / "not" / "yet" / ".venv"
    out = need_disk(venv, free_gib(tmp_path) + 1000)
    assert out.returncode == 1 and " GiB free" in out.stderr and "has  GiB" not in out.stderr, out.stderr
    assert "df: " not in out.stderr


def test_pip_output_goes_to_the_log_and_only_a_failure_reaches_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "pip.log"
    script = (f'source "{LIB}"; PIP_LOG="{log}"; '
              'quiet bash -c "echo ERROR: resolver noise >&2; echo fine"; echo "rc=$?"; '
              'quiet bash -c "echo it broke >&2; exit 3"; echo "rc=$?"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["rc=0", "rc=3"]
    assert "resolver noise" not in out.stderr  # an expected pip complaint stays in the log
    assert "this failed (exit 3)" in out.stderr and "it broke" in out.stderr and str(log) in out.stderr
    assert "ERROR: resolver noise" in log.read_text() and "fine" in log.read_text()


def test_every_module_with_an_mcore019_test_is_in_the_second_venvs_list() -> None:
    """scripts/test.sh runs `-m "not slow or mcore019"` over MCORE_TESTS only: a test marked
    mcore019 in a module outside that list would silently never meet megatron-core 0.19."""
    import glob
    import re
    script = (ROOT / "scripts" / "test.sh").read_text()
    found = re.search(r"MCORE_TESTS=\((.*?)\)", script, re.S)
    assert found is not None, "scripts/test.sh lists no MCORE_TESTS"
    listed = found.group(1).split()
    covered = {Path(p).name for pattern in listed for p in glob.glob(str(ROOT / pattern))}
    mark = re.compile(r"^(@pytest\.mark\.mcore019|pytestmark = .*pytest\.mark\.mcore019)", re.M)
    marked = {p.name for p in (ROOT / "tests").rglob("test_*.py") if mark.search(p.read_text())}
    assert marked and marked <= covered, sorted(marked - covered)
