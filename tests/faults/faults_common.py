"""Helpers of the fault-injection suite (tests/faults/): running `gspo-megatron train` as a user
does, reading its one-line errors, mounting small or read-only filesystems (CI runs as root)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_trainer_e2e import base_overrides

CONFIG = "examples/tiny_moe_larger_digit.yaml"


def dead_url() -> str:
    from rollout.servers.ports import free_port
    return f"http://127.0.0.1:{free_port()}"


def in_process_error(capsys, argv: list[str]) -> str:
    """`gspo-megatron train argv` in this process: exit code 2 and exactly one error line."""
    from gspo_megatron.cli import main
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def train_args(run_dir: Path, url: str, **extra) -> list[str]:
    return [CONFIG, *base_overrides(run_dir, url, **extra)]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str = "3m", read_only: bool = False):
    """A tmpfs of `size` at `mnt` (read-only when asked); unmounted on exit."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def remount(mnt: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mnt)], check=True)
