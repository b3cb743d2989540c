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
else
  # The trainer's own server launcher: on CPU the CPU engine, float32 and the sgl_kernel stand-in.
  cmd=("$GSPO_PYTHON" -m rollout.servers.launch)
fi
read -ra extra <<<"${GSPO_SERVER_ARGS:-}"
if [[ -n ${GSPO_LOG_DIR:-} ]]; then
  exec >>"$GSPO_LOG_DIR/server-${SLURMD_NODENAME:-$(hostname -s)}-s$idx.log" 2>&1
fi
echo "[gspo-launch] server $idx on $(hostname) port $port: ${cmd[*]} ${extra[*]}" >&2
exec "${cmd[@]}" --model-path "$GSPO_MODEL_PATH" --host "$GSPO_SERVER_HOST" --port "$port" "${extra[@]}"
