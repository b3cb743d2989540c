"""Every `some/path.py` (or .md, .sh, .yaml, .sbatch) that a doc, a Python file or a script of
the project mentions and no file answers: a pointer left behind by a move or a rename.

    python tests/docs/stale_paths.py          # FILE:LINE: PATH, one a line; exit 1 when any

Read: every *.md anywhere in the checkout, every *.py, and every file of the scripts (scripts/,
launch/, .ci/, examples/ but its data). A mention answers to a file of the checkout (tracked or not
ignored) whose path ends with it (`sync/stream.py` is gspo_megatron/sync/stream.py), or to one of
the installed packages' files (sglang/srt/..., megatron/core/...). What is left is either stale or a
file that is not ours to have: a peer's repository (verl/, roll/, slime/), a file a recipe or a test
creates, a path outside the checkout; a reader tells them apart (tests/docs/test_stale_paths.py
lists the second kind).
"""
from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS = ("py", "md", "sh", "yaml", "sbatch")
# A path or a glob (`tests/actor/test_actor_*.py`: it must match a file), after a shell variable
# that stands for a root (`$ROOT/launch/rank.sh`) if any. A config is checked only with its folder
# in front: a bare `run.yaml` names the reader's own.
MENTION = re.compile(rf"(?<![\w./$*])(?:\$\{{?\w+\}}?/)?((?:[\w.*][\w.*-]*/)*[\w*-]+\.(?:{'|'.join(EXTENSIONS)}))\b")
SCRIPTS = ("scripts/", "launch/", ".ci/", "examples/")


def read(f: str) -> bool:
    """A doc, a Python file or a script: the files whose mentions are checked."""
    if f.startswith("examples/data/"):
        return False
    return f.endswith((".md", ".py")) and not f.startswith("runs/") or f.startswith(SCRIPTS)


def _suffixes(paths: set[str]) -> set[str]:
    return {"/".join(parts[i:]) for p in paths for parts in [p.split("/")] for i in range(len(parts))}


def stale_mentions(root: Path = ROOT) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    installed = {str(p.relative_to(sp)) for venv in (".venv", ".venv-mcore019")
                 for sp in root.glob(f"{venv}/lib/python3*/site-packages")
                 for p in sp.rglob("*") if p.suffix.lstrip(".") in EXTENSIONS}
    known = _suffixes(set(files)) | _suffixes(installed)

    def answered(mention: str) -> bool:
        path = mention.lstrip("./")
        if "*" in path:
            return any(fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, f"*/{path}") for f in files)
        return path in known or ("/" not in path and path.endswith(".yaml"))

    out = []
    for f in sorted(files):
        if not read(f) or not (root / f).is_file():
            continue
        for n, line in enumerate((root / f).read_text(errors="replace").splitlines(), 1):
            out += [f"{f}:{n}: {m.group(1)}" for m in MENTION.finditer(line) if not answered(m.group(1))]
    return out


if __name__ == "__main__":
    found = stale_mentions()
    print("\n".join(found))
    sys.exit(1 if found else 0)
