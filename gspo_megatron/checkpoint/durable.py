"""Durable small writes (stdlib only, so that start-up checks can use them before torch is imported):
fsync a file or a directory, write a JSON file and fsync it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make a rename / file creation in `path` durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
