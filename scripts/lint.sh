#!/usr/bin/env bash
# The linter and the type checker, at zero findings (scripts/test.sh runs this before the tests):
#   bash scripts/lint.sh     # ruff (pyflakes' rules) over every Python file, then mypy over the
#                            # packages, tools/, benchmarks/, launch/ and tests/ (pyproject.toml)
# What each checks, at which strictness and why: docs/architecture.md, "Types and lint".
# Uses .venv as scripts/setup.sh builds it (scripts/test.sh builds it first).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
t0=$SECONDS
"$ROOT/.venv/bin/ruff" check --quiet .
"$ROOT/.venv/bin/python" -m mypy  # with its cache (.mypy_cache) warm 2-4 s, fresh 35-130 s
echo "[lint] ruff and mypy: no findings ($((SECONDS - t0)) s)" >&2
