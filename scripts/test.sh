#!/usr/bin/env bash
# Runs the test suite (sets up .venv on first use):
#   bash scripts/test.sh                 # everything, as CI does
#   bash scripts/test.sh -m "not slow"   # the quick loop: no multi-process or server tests
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
