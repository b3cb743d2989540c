#!/usr/bin/env bash
# Builds .venv-mcore019: Python 3.12 with megatron-core 0.19.2, the newest release the declared
# range (pyproject.toml: megatron-core>=0.16.1,<0.20) admits and what `pip install` gives a Python
# 3.12 user. scripts/test.sh runs the tests of the code that reaches megatron-core in it, so
# both ends of the range are tested. No SGLang here (its tests run in .venv).
#   bash scripts/setup_mcore019.sh     # idempotent; ~2 minutes and ~6 GB the first time
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON312:-}"
if [[ -z "$PY" ]]; then
  # pyenv's shims exist for versions that are not selected: try each candidate for real.
  for c in "$HOME"/.pyenv/versions/3.12*/bin/python python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      PY="$c"; break
    fi
  done
fi
if [[ -z "$PY" ]]; then
  echo "[setup-mcore019] no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
fi
VENV="$ROOT/.venv-mcore019"
STAMP="$VENV/.gspo_setup_stamp"
want="$(cat pyproject.toml scripts/setup_mcore019.sh scripts/setup_lib.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
source "$ROOT/scripts/setup_lib.sh"
need_disk setup-mcore019 "$VENV" 7   # measured: 5.7 GiB when built
echo "[setup-mcore019] building $VENV with $("$PY" --version)" >&2
t0=$SECONDS
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP_LOG="$VENV/setup-pip.log"
: > "$PIP_LOG"
echo "[setup-mcore019] pip's output goes to $PIP_LOG" >&2
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch 2.14.1 as in .venv (from PyPI for 3.12: a CUDA build, which runs on the CPU too).
quiet "${PIP[@]}" install torch==2.14.1
quiet "${PIP[@]}" install "megatron-core==0.19.2" "transformers==5.19.0" "tokenizers==0.23.2" -e ".[test]"
"$VENV/bin/python" -c "$QUIET_IMPORTS
exec(open('/dev/stdin').read())" <<'PY'
# megatron.core.__version__ gains "+<git sha>" of whatever repository holds the venv
# (megatron/core/package_info.py runs `git rev-parse` in its own directory): ask the metadata.
from importlib.metadata import version
import megatron.core, torch
assert version("megatron-core") == "0.19.2", version("megatron-core")
print(f"[setup-mcore019] torch {torch.__version__}, megatron-core {version('megatron-core')}")
PY
echo "$want" > "$STAMP"
echo "[setup-mcore019] done in $((SECONDS - t0)) s" >&2
