#!/usr/bin/env bash
# On the GPU machine, from the repository root (docs/gpu.md, "The acceptance run"): installs into
# the machine's Python ($PYTHON, else python3) what scripts/gpu/prepare.sh downloaded here. Each
# device call carries one Transformer Engine part (.gpu_pK/); the parts pile up in $GSPO_TE_PARTS
# (/tmp/gspo_te_parts) until the last call, which also carries .gpu/: megatron-core,
# flash-linear-attention and the small wheels installed, TE's core wheel put back together (its
# checksum checked) and installed, and its torch extension built against the machine's torch
# (about 2 minutes on 16 cores).
#   bash scripts/gpu/device_setup.sh --collect   # the calls that carry one part each: keep it
#   bash scripts/gpu/device_setup.sh             # the last call (its part and .gpu/): install
# With no part at all it installs megatron-core alone: the local-spec rows
# (scripts/gpu_acceptance.sh --only 0,1.1,1.2,1.3,1.4) can pass, the TE rows cannot.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}" PARTS="${GSPO_TE_PARTS:-/tmp/gspo_te_parts}"
die() { echo "device_setup: $*" >&2; exit 1; }
cd "$ROOT" || exit 1
case "${1:-}" in --collect|"") ;; *) die "unknown option $1 (--collect, or nothing)" ;; esac
bash scripts/gpu/parts.sh collect "$PARTS" .gpu_p || exit 1
[[ "${1:-}" == --collect ]] && exit 0

pip_install() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" 2>&1 | tail -3; }
compgen -G ".gpu/whl/*.whl" >/dev/null || die "no wheels in .gpu/whl: carry .gpu (scripts/gpu/prepare.sh makes it)"
pip_install .gpu/whl/*.whl || die "the wheels of .gpu/whl did not install"
if "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
  echo "[gpu] Transformer Engine already importable"; exit 0
fi
if [[ ! -f "$PARTS/PARTS" ]]; then
  echo "[gpu] no Transformer Engine part arrived: megatron-core only (the local spec)"; exit 0
fi
wheel="$(bash scripts/gpu/parts.sh join "$PARTS" /tmp/gspo_te_wheel)" || exit 1
pip_install .gpu/te_small/*.whl "$wheel" || die "Transformer Engine's wheels did not install"
build=/tmp/gspo_te_torch
rm -rf "$build" && mkdir -p "$build" && tar -xzf .gpu/te_small/transformer_engine_torch-*.tar.gz -C "$build" ||
  die "no transformer_engine_torch source in .gpu/te_small"
# Hopper (sm_90) unless told otherwise; the build log is kept for a failure
(cd "$build"/transformer_engine_torch-* && NVTE_FRAMEWORK=pytorch MAX_JOBS="$(nproc)" NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90}" \
   "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . > "$build.log" 2>&1) ||
  { tail -30 "$build.log"; die "the torch extension did not build (the whole log: $build.log)"; }
"$PY" -c "import transformer_engine, transformer_engine.pytorch; print('[gpu] TE', transformer_engine.__version__)" 2>&1 | tail -1
