#!/usr/bin/env bash
# Runs the test suite (sets up what it needs on first use):
#   bash scripts/test.sh                 # everything, as CI does: the suite in .venv (Python 3.11,
#                                        # megatron-core 0.16.1), then the fast suite and the
#                                        # conversion and layout tests in .venv-mcore019 (Python
#                                        # 3.12, megatron-core 0.19.2): both ends of the declared range
#   bash scripts/test.sh -m "not slow"   # the quick loop: .venv only, no multi-process or server tests
#   bash scripts/test.sh ARGS...         # any pytest arguments: .venv only
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [[ $# -gt 0 ]]; then
  exec "$ROOT/.venv/bin/python" -m pytest "$@"
fi
"$ROOT/.venv/bin/python" -m pytest
echo "[test] megatron-core 0.19.2 (Python 3.12): the fast suite, conversion and layout tests" >&2
bash "$ROOT/scripts/setup_mcore019.sh"
"$ROOT/.venv-mcore019/bin/python" -m pytest -p no:cacheprovider -m "not slow or mcore019"
