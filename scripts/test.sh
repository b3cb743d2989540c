#!/usr/bin/env bash
# Runs the test suite (sets up what it needs on first use):
#   bash scripts/test.sh                 # everything, as CI does: the suite in .venv (Python 3.11,
#                                        # megatron-core 0.16.1), then the tests of the code that
#                                        # builds or loads megatron-core objects in .venv-mcore019
#                                        # (Python 3.12, megatron-core 0.19.2): both ends of the range
#   bash scripts/test.sh -m "not slow"   # the quick loop: .venv only, no multi-process or server tests
#   bash scripts/test.sh ARGS...         # any pytest arguments: .venv only
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [[ $# -gt 0 ]]; then
  exec "$ROOT/.venv/bin/python" -m pytest "$@"
fi
# The second venv builds (first use: about 4 minutes, mostly unpacking wheels) while the first
# suite runs; its output goes to a log shown if the build fails.
SETUP019_LOG="$(mktemp)"
bash "$ROOT/scripts/setup_mcore019.sh" >"$SETUP019_LOG" 2>&1 &
SETUP019=$!
# Every command of the trap must succeed: under `set -e` a failing one (kill of the build that
# already ended) would make the script exit 1 after a green suite.
trap 'kill "$SETUP019" 2>/dev/null || true; wait "$SETUP019" 2>/dev/null || true; rm -f "$SETUP019_LOG"' EXIT
"$ROOT/.venv/bin/python" -m pytest
# The second end of the range: the modules whose code builds or loads megatron-core objects (model
# specs, the actor, conversion, checkpoints, layouts, the CPU adaptations), their fast tests and
# the multi-rank ones marked mcore019. The rest (rollouts, rewards, config, launch, metrics) runs
# the same torch and transformers in both venvs and never reaches megatron-core; SGLang is not
# installed there.
MCORE_TESTS=(tests/test_actor_*.py tests/test_model_*.py tests/test_convert_*.py tests/test_spec_names.py
             tests/test_weight_maps.py tests/test_extra_state.py tests/test_cpu_compat.py tests/test_packing.py
             tests/test_microbatches.py tests/test_compute_settings.py tests/test_architecture.py
             tests/test_published_configs.py tests/test_tiny_model.py tests/test_planner.py tests/test_layout.py
             tests/test_context_parallel.py tests/test_uneven_pipeline*.py tests/test_machine_profiles.py
             tests/test_resume_checkpoint.py tests/test_logprobs_tp2.py tests/test_routing_replay.py
             tests/test_comm_devices.py tests/test_host_syncs.py tests/test_lazy_compile.py)
echo "[test] megatron-core 0.19.2 (Python 3.12): ${#MCORE_TESTS[@]} modules that reach megatron-core" >&2
if ! wait "$SETUP019"; then
  cat "$SETUP019_LOG" >&2
  echo "[test] building .venv-mcore019 failed (its output above)" >&2
  exit 1
fi
grep -v '^$' "$SETUP019_LOG" >&2 || true
"$ROOT/.venv-mcore019/bin/python" -m pytest -p no:cacheprovider -m "not slow or mcore019" "${MCORE_TESTS[@]}"
