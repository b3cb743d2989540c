"""Write a made task's JSONL files whole or not at all (tools/make_*_task.py)."""
from __future__ import annotations

import json
from pathlib import Path


def write_task_files(out_dir: str | Path, files: dict[str, list[dict]]) -> dict[str, Path]:
    """`files`: name -> rows; writes out_dir/<name>.jsonl through a temporary file each, so an
    interrupted run leaves the previous file or none, never a truncated one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in files.items():
        path = out / f"{name}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
        paths[name] = path
    return paths
