"""Every `some/path.py` (or .md, .sh) that a *.md or *.py file of the project mentions and no file
answers: a pointer left behind by a move or a rename.

    python tests/docs/stale_paths.py          # FILE:LINE: PATH, one a line; exit 1 when any

A mention answers to a file of the checkout (tracked or not ignored) whose path ends with it
(`sync/stream.py` is gspo_megatron/sync/stream.py), or to one of the installed packages' files
(sglang/srt/..., megatron/core/...). What is left is either stale or a file that is not ours to
have: a peer's repository (verl/, roll/, slime/), a file a recipe or a test creates, a path
outside the checkout; a reader tells them apart.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh))\b")


def _suffixes(paths: set[str]) -> set[str]:
    return {"/".join(parts[i:]) for p in paths for parts in [p.split("/")] for i in range(len(parts))}


def stale_mentions(root: Path = ROOT) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    installed = {str(p.relative_to(sp)) for venv in (".venv", ".venv-mcore019")
                 for sp in root.glob(f"{venv}/lib/python3*/site-packages")
                 for p in sp.rglob("*") if p.suffix in (".py", ".md", ".sh")}
    known = _suffixes(set(files)) | _suffixes(installed)
    out = []
    for f in sorted(files):
        if not f.endswith((".py", ".md")) or f.startswith(("runs/", ".")) or not (root / f).is_file():
            continue
        for n, line in enumerate((root / f).read_text(errors="replace").splitlines(), 1):
            out += [f"{f}:{n}: {m.group(1)}" for m in MENTION.finditer(line)
                    if m.group(1).lstrip("./") not in known]
    return out


if __name__ == "__main__":
    found = stale_mentions()
    print("\n".join(found))
    sys.exit(1 if found else 0)
