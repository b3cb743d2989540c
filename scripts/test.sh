#!/usr/bin/env bash
# Runs the test suite (sets up what it needs on first use):
#   bash scripts/test.sh                 # everything, as CI does: the suite in .venv (Python 3.11,
#                                        # megatron-core 0.16.1), then the tests of the code that
#                                        # builds or loads megatron-core objects in .venv-mcore019
#                                        # (Python 3.12, megatron-core 0.19.2): both ends of the range;
#                                        # two pytest workers, a test file each at a time
#   bash scripts/test.sh -m "not slow"   # the quick loop: .venv only, no multi-process or server tests
#   bash scripts/test.sh ARGS...         # any pytest arguments: .venv only
# Every form first runs the linter and the type checker (scripts/lint.sh: ruff, mypy), which must
# find nothing: a name that a move broke fails here, in seconds, not on a GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
bash "$ROOT/scripts/lint.sh"
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
# Two workers, whole files each (pytest-xdist --dist loadfile: a module's shared servers and models
# stay one worker's): much of a test's time is waiting on servers and subprocesses, so the second
# core was idle half the time with one. The files go out heaviest first (tests/conftest.py orders
# them; --no-loadscope-reorder keeps that order instead of xdist's, most tests first), so that the
# run does not end on one worker with a 100 s test while the other idles.
"$ROOT/.venv/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder
# The second end of the range: the modules whose code builds or loads megatron-core objects (model
# specs, the actor, conversion, checkpoints, layouts, the CPU adaptations), their fast tests and
# the multi-rank ones marked mcore019. The rest (rollouts, rewards, config, launch, metrics) runs
# the same torch and transformers in both venvs and never reaches megatron-core; SGLang is not
# installed there.
MCORE_TESTS=(tests/actor/test_actor_*.py tests/actor/test_batch.py tests/actor/test_weights.py
             tests/actor/test_packing.py tests/actor/test_token_budget.py tests/actor/test_settings_compute.py
             tests/actor/test_settings_machine_profiles.py tests/actor/test_logprobs_tp2.py
             tests/actor/test_router_control.py tests/actor/test_steps_host_syncs.py
             tests/model_specs/test_families.py tests/model_specs/test_deepseek_v3.py
             tests/model_specs/test_gpt_oss.py tests/checkpoint/test_convert_gpt_oss.py
             tests/model_specs/test_qwen3_next.py
             tests/model_specs/test_common.py tests/model_specs/test_spec_names.py
             tests/model_specs/test_weight_maps.py tests/model_specs/test_published.py
             tests/model_specs/test_lazy_compile.py tests/checkpoint/test_convert.py
             tests/checkpoint/test_convert_mla.py tests/tools/test_convert_tools.py
             tests/checkpoint/test_model_io_*.py tests/checkpoint/test_checkpoint_manager.py
             tests/parallel/test_cpu_compat.py tests/parallel/test_layout*.py tests/parallel/test_context.py
             tests/parallel/test_comm.py tests/tools/test_check_imports.py tests/tools/test_make_tiny_model.py
             tests/planner/test_planner.py)
echo "[test] megatron-core 0.19.2 (Python 3.12): ${#MCORE_TESTS[@]} modules that reach megatron-core" >&2
if ! wait "$SETUP019"; then
  cat "$SETUP019_LOG" >&2
  echo "[test] building .venv-mcore019 failed (its output above)" >&2
  exit 1
fi
grep -v '^$' "$SETUP019_LOG" >&2 || true
"$ROOT/.venv-mcore019/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -m "not slow or mcore019" "${MCORE_TESTS[@]}"
