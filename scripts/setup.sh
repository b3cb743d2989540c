#!/usr/bin/env bash
# Builds the project's virtual environment (.venv at the repository root) on a fresh CPU machine.
#   bash scripts/setup.sh          # idempotent: does nothing when .venv matches the inputs
# One venv serves the trainer and the SGLang servers (docs/cpu.md):
#   torch 2.14.1 + torchvision 0.29.1 (wheels on local disk; the versions sglang pins),
#   megatron-core and this project (editable), sglang --no-deps + its CPU-safe requirements.
# On GPU clusters install torch/TE/apex/sglang the usual way and `pip install -e .[gpu,rollout]`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV="$ROOT/.venv"
STAMP="$VENV/.gspo_setup_stamp"
inputs_hash() { cat pyproject.toml requirements/*.txt scripts/setup.sh scripts/setup_lib.sh | sha256sum | cut -d' ' -f1; }
want="$(inputs_hash)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
source "$ROOT/scripts/setup_lib.sh"
need_disk setup "$VENV" 9   # measured: 7.1 GiB when built, plus pip's unpacking room
echo "[setup] building $VENV (first use; about 3-4 minutes, 7 GiB)" >&2
t0=$SECONDS
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP_LOG="$VENV/setup-pip.log"
: > "$PIP_LOG"
echo "[setup] pip's output goes to $PIP_LOG (its lines about CUDA packages sglang lists but a CPU machine leaves out are expected: requirements/sglang-cpu.txt)" >&2
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
PIN="$(mktemp)"; trap 'rm -f "$PIN"' EXIT
printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$PIN"
quiet "${PIP[@]}" install torch==2.14.1 torchvision==0.29.1
quiet "${PIP[@]}" install -c "$PIN" -e ".[test,bench]"
# sglang pins CUDA-only kernels that cannot install on CPU: take the wheel alone, then the CPU-safe
# subset of its requirements (requirements/sglang-cpu.txt says what is left out and why).
quiet "${PIP[@]}" install -c "$PIN" --no-deps "sglang==0.5.23"
quiet "${PIP[@]}" install -c "$PIN" -r requirements/sglang-cpu.txt
"$VENV/bin/python" -c "$QUIET_IMPORTS
exec(open('/dev/stdin').read())" <<'PY'
import torch, megatron.core, sglang, transformers, tensorboard  # noqa: F401  fail here, not in a test
print(f"[setup] torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"sglang {sglang.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$STAMP"
echo "[setup] done in $((SECONDS - t0)) s" >&2
