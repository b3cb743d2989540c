#!/usr/bin/env bash
# The main job: GSPO on a tiny Qwen3-MoE, on CPU, with a real SGLang server, watched in TensorBoard.
#   bash scripts/main_job.sh                       # from a fresh machine: set-up, model, train, export
#   bash scripts/main_job.sh --set train.steps=10  # extra overrides go to `gspo-megatron train`
#   CONFIG=examples/tiny_moe_roll_gspo.yaml bash scripts/main_job.sh
#   BASE_CONFIG=examples/tiny_moe_sft.yaml CONFIG=examples/tiny_moe_lora.yaml bash scripts/main_job.sh
#     (BASE_CONFIG: a run made first, once, whose HF export is CONFIG's model: LoRA's base)
# Steps: build .venv (scripts/setup.sh), make the tiny random MoE if missing
# (tools/make_tiny_model.py), train (examples/tiny_moe_larger_digit.yaml: a short supervised warm
# start, then GSPO; resumes from its checkpoint dir if a previous run was interrupted), export the
# final policy to HF format, print the reward curve's ends, the held-out accuracy at both ends, the
# export and the TensorBoard command, with the config's folders (tools/run_summary.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"
CONFIG="${CONFIG:-examples/tiny_moe_larger_digit.yaml}"
MODEL="runs/models/tiny-qwen3-moe"
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "[main_job] making the tiny MoE at $MODEL"
  "$PY" tools/make_tiny_model.py --arch qwen3_moe --out "$MODEL" --seed 0
fi
if [[ -n "${BASE_CONFIG:-}" ]]; then
  BASE="$("$PY" -c 'import sys; from gspo_megatron.config import load_config; print(load_config(sys.argv[1]).checkpoint.export_hf or "")' "$BASE_CONFIG")"
  if [[ -z "$BASE" ]]; then echo "[main_job] BASE_CONFIG=$BASE_CONFIG exports nothing (checkpoint.export_hf)" >&2; exit 2; fi
  if [[ ! -f "$BASE/config.json" ]]; then
    echo "[main_job] making the base $BASE ($BASE_CONFIG)"
    "$ROOT/.venv/bin/gspo-megatron" train "$BASE_CONFIG"
  fi
fi
t0=$SECONDS
"$ROOT/.venv/bin/gspo-megatron" train "$CONFIG" "$@"
echo "[main_job] training took $((SECONDS - t0)) s"
"$PY" tools/run_summary.py "$CONFIG" "$@"  # reward, held-out accuracy, the export, TensorBoard: the config's paths
