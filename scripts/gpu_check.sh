#!/usr/bin/env bash
# The GPU acceptance run (tools/gpu_check.py): HF -> megatron -> actor on CUDA (fp32, bf16) ->
# log-probs vs transformers -> GSPO step -> checkpoint loaded into the local and the TE spec ->
# export to HF, as a table; then the fused log-prob benchmark in bf16. Exits 1 if a row fails.
#   bash scripts/gpu_check.sh             # on a GPU machine with megatron-core (and TE) installed
# Uses $PYTHON when set (scripts/gpu_acceptance.sh passes its own), else .venv/bin/python when it
# exists, else `python3` (a GPU machine whose packages are installed into its system Python; docs/gpu.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || command -v "$PY" >/dev/null || PY=python3
cd "$ROOT"
exec "$PY" tools/gpu_check.py "$@"
