#!/usr/bin/env bash
# One SGLang server (started by launch/local.sh, or by srun in the sbatch scripts):
#   launch/server.sh [INDEX]        # INDEX defaults to $SLURM_PROCID (servers numbered across nodes)
# Listens on GSPO_SERVER_HOST:(GSPO_SERVER_PORT + INDEX): ports never collide, even when emulated
# nodes share one address. Logs to $GSPO_LOG_DIR/server-<node>-s<INDEX>.log when GSPO_LOG_DIR is set. With GPUs and several servers per node, server k on a node sees only its
# share of the node's GPUs (CUDA_VISIBLE_DEVICES). Parameters: launch/common.sh.
set -euo pipefail
idx=${1:-${SLURM_PROCID:?launch/server.sh needs INDEX or SLURM_PROCID}}
local_idx=${SLURM_LOCALID:-$idx}
port=$(( GSPO_SERVER_PORT + idx ))
if (( GSPO_GPUS_PER_NODE > 0 && GSPO_SERVERS_PER_NODE > 1 )); then
  per=$(( GSPO_GPUS_PER_NODE / GSPO_SERVERS_PER_NODE ))
  IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GSPO_GPUS_PER_NODE - 1 )))}"
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${visible[*]:$(( local_idx * per )):$per}")
  export CUDA_VISIBLE_DEVICES
fi
if [[ -n ${GSPO_SERVER_CMD:-} ]]; then
  read -ra cmd <<<"$GSPO_SERVER_CMD"
elif grep -q '__main__' "$GSPO_ROOT/rollout/server.py" 2>/dev/null; then
  cmd=("$GSPO_PYTHON" -m rollout.server)
else
  # rollout.server has no command line yet: SGLang's own launcher. On CPU, the flags and the
  # sgl_kernel stand-in that ENVIRONMENT.md found necessary.
  cmd=("$GSPO_PYTHON" -m sglang.launch_server)
  if (( GSPO_GPUS_PER_NODE == 0 )); then
    cmd+=(--device cpu --attention-backend torch_native --dtype float32
          --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled
          --max-total-tokens 16384 --mem-fraction-static 0.05 --skip-server-warmup --sleep-on-idle)
    export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1
    export PYTHONPATH=$GSPO_ROOT/rollout/cpu_stand_ins${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
read -ra extra <<<"${GSPO_SERVER_ARGS:-}"
if [[ -n ${GSPO_LOG_DIR:-} ]]; then
  exec >>"$GSPO_LOG_DIR/server-${SLURMD_NODENAME:-$(hostname -s)}-s$idx.log" 2>&1
fi
echo "[gspo-launch] server $idx on $(hostname) port $port: ${cmd[*]} ${extra[*]}" >&2
exec "${cmd[@]}" --model-path "$GSPO_MODEL_PATH" --host "$GSPO_SERVER_HOST" --port "$port" "${extra[@]}"
