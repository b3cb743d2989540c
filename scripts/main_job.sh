#!/usr/bin/env bash
# The main job: GSPO on a tiny Qwen3-MoE, on CPU, with a real SGLang server, watched in TensorBoard.
#   bash scripts/main_job.sh                       # from a fresh machine: set-up, model, train, export
#   bash scripts/main_job.sh --set train.steps=10  # extra overrides go to `gspo-megatron train`
#   CONFIG=examples/tiny_moe_roll_gspo.yaml RUN=runs/tiny_moe_roll_gspo bash scripts/main_job.sh
#   BASE_CONFIG=examples/tiny_moe_sft.yaml CONFIG=examples/tiny_moe_lora.yaml RUN=runs/tiny_moe_lora bash scripts/main_job.sh
#     (BASE_CONFIG: a run made first, once, whose HF export is CONFIG's model: LoRA's base)
# Steps: build .venv (scripts/setup.sh), make the tiny random MoE if missing
# (tools/make_tiny_model.py), train (examples/tiny_moe_larger_digit.yaml: a short supervised warm
# start, then GSPO; resumes from its checkpoint dir if a previous run was interrupted), export the
# final policy to HF format, print the reward curve's ends, the held-out accuracy at both ends and the TensorBoard command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"
CONFIG="${CONFIG:-examples/tiny_moe_larger_digit.yaml}"
MODEL="runs/models/tiny-qwen3-moe"
RUN="${RUN:-runs/tiny_moe_larger_digit}"  # the run folder of CONFIG (its tensorboard/)
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
"$PY" - "$RUN/tensorboard" <<'PY'
import sys
from gspo_megatron.run.metrics import read_scalars
scalars = read_scalars(sys.argv[1])
rewards = scalars.get("rollout/reward_mean", [])
if rewards:
    (s0, r0), (s1, r1) = rewards[0], rewards[-1]
    best = max(r for _, r in rewards)
    last = [r for _, r in rewards[-10:]]
    print(f"[main_job] reward: step {s0} {r0:.3f} -> step {s1} {r1:.3f} (best {best:.3f}, "
          f"last {len(last)} steps' mean {sum(last) / len(last):.3f})")
held_out = scalars.get("eval/accuracy", [])
if len(held_out) > 1:  # what the policy learned, on phrasings training never showed
    (s0, a0), (s1, a1) = held_out[0], held_out[-1]
    print(f"[main_job] held-out accuracy (greedy): step {s0} {a0:.3f} -> step {s1} {a1:.3f}")
PY
echo "[main_job] final policy (HF format): $RUN/final_hf"
echo "[main_job] watch it: $ROOT/.venv/bin/tensorboard --logdir $RUN/tensorboard"
