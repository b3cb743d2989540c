#!/usr/bin/env bash
# The same run as launch/slurm/*.sbatch, on one machine: SGLang server(s) + torchrun trainer ranks.
#
#   launch/local.sh [options] CONFIG.yaml [--set key=value ...]
#
#   --procs N          GSPO_PROCS_PER_NODE    trainer ranks (torchrun --nproc-per-node)  (GPUs, or 1)
#   --gpus G           GSPO_GPUS_PER_NODE     GPUs to use; 0 = CPU with gloo  (the GPUs nvidia-smi lists)
#   --servers K        GSPO_SERVERS_PER_NODE  SGLang servers to start; 0 = none, no URLs passed
#                                             (the trainer then starts its own)               (1)
#   --model-path DIR   GSPO_MODEL_PATH        HF model directory for the servers
#   --server-urls U,U  GSPO_SERVER_URLS       use servers that are already running instead
#   --run-dir DIR      GSPO_RUN_DIR           logs + checkpoints            (runs/<config stem>)
#
# Other parameters (GSPO_TRAIN_CMD, GSPO_SERVER_ARGS, GSPO_SERVER_PORT, ...): launch/common.sh.
# Logs: $GSPO_RUN_DIR/logs/local.<time>/{trainer-<host>-r<rank>,server-<host>-s<i>}.log; rank 0 is
# also printed here. Resume: run the same command again (same run directory): the trainer resumes
# from checkpoint.dir/latest. Ctrl-C stops the trainer and the servers.
set -euo pipefail
GSPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export GSPO_ROOT
# shellcheck source=common.sh
source "$GSPO_ROOT/launch/common.sh"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
need() { (( $# >= 2 )) && [[ -n $2 ]] || gspo_die "option $1 needs a value"; }
CONFIG= SETS=()
while (( $# )); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --procs) need "$@"; GSPO_PROCS_PER_NODE=$2; shift 2 ;;
    --gpus) need "$@"; GSPO_GPUS_PER_NODE=$2; shift 2 ;;
    --servers) need "$@"; GSPO_SERVERS_PER_NODE=$2; shift 2 ;;
    --model-path) need "$@"; GSPO_MODEL_PATH=$2; shift 2 ;;
    --server-urls) need "$@"; GSPO_SERVER_URLS=$2; shift 2 ;;
    --run-dir) need "$@"; GSPO_RUN_DIR=$2; shift 2 ;;
    --set) need "$@"; SETS+=(--set "$2"); shift 2 ;;
    -*) gspo_die "unknown option '$1' (see --help)" ;;
    *) [[ -z $CONFIG ]] || gspo_die "a second config '$1' after '$CONFIG': give one CONFIG.yaml"; CONFIG=$1; shift ;;
  esac
done
[[ -n $CONFIG ]] || gspo_die "no config given (usage: launch/local.sh [options] CONFIG.yaml [--set k=v ...])"

if [[ -z ${GSPO_GPUS_PER_NODE:-} ]]; then
  GSPO_GPUS_PER_NODE=0
  if command -v nvidia-smi >/dev/null && [[ ${CUDA_VISIBLE_DEVICES-unset} != "" ]]; then
    GSPO_GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
fi
GSPO_MODE=local GSPO_NODES=1 GSPO_SERVER_NODES=0
GSPO_SERVER_HOST=${GSPO_SERVER_HOST:-127.0.0.1}
gspo_defaults "$CONFIG"
gspo_check_inputs "$CONFIG" "${SETS[@]}"
gspo_comm_env
if (( GSPO_GPUS_PER_NODE == 0 )) && [[ -z ${OMP_NUM_THREADS:-} ]]; then
  threads=$(( $(nproc) / GSPO_PROCS_PER_NODE )); export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
TORCHRUN=$(dirname "$GSPO_PYTHON")/torchrun
[[ -x $TORCHRUN ]] || gspo_die "torchrun not found beside GSPO_PYTHON ($TORCHRUN)"

GSPO_LOG_DIR=$GSPO_RUN_DIR/logs/local.$(date +%Y%m%d-%H%M%S)
export GSPO_LOG_DIR
mkdir -p "$GSPO_LOG_DIR" "$GSPO_CHECKPOINT_DIR"

SERVER_PIDS=() URLS=() TRAIN_PID=
cleanup() {
  trap '' INT TERM
  [[ -n $TRAIN_PID ]] && gspo_stop "$TRAIN_PID" "$GSPO_STOP_GRACE"
  local pid
  for pid in "${SERVER_PIDS[@]}"; do  # each server leads its own process group (SGLang forks)
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  for pid in "${SERVER_PIDS[@]}"; do
    gspo_stop "$pid" 30
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if gspo_launches_servers; then
  for (( i = 0; i < GSPO_SERVERS_PER_NODE; i++ )); do
    port=$(( GSPO_SERVER_PORT + i ))
    if "$GSPO_PYTHON" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
      gspo_die "port $port is in use: choose another GSPO_SERVER_PORT"
    fi
    setsid "$GSPO_ROOT/launch/server.sh" "$i" &
    SERVER_PIDS+=($!)
    URLS+=("http://127.0.0.1:$port")
  done
  gspo_log "waiting up to $GSPO_SERVER_TIMEOUT s for ${#URLS[@]} server(s): ${URLS[*]}"
  gspo_wait_healthy "$GSPO_SERVER_TIMEOUT" "$(IFS=,; echo "${SERVER_PIDS[*]}")" "${URLS[@]}" || exit 1
elif [[ -n $GSPO_SERVER_URLS ]]; then
  IFS=, read -ra URLS <<<"$GSPO_SERVER_URLS"
fi

read -ra train_cmd <<<"$GSPO_TRAIN_CMD"
sets=(--set "checkpoint.dir=$GSPO_CHECKPOINT_DIR")
(( ${#URLS[@]} )) && sets+=(--set "rollout.server_urls=[$(IFS=,; echo "${URLS[*]}")]")
[[ -e $GSPO_CHECKPOINT_DIR/latest ]] && gspo_log "resuming from $GSPO_CHECKPOINT_DIR/latest"
gspo_log "trainer: $GSPO_PROCS_PER_NODE rank(s), logs in $GSPO_LOG_DIR"
"$TORCHRUN" --standalone --nnodes 1 --nproc-per-node "$GSPO_PROCS_PER_NODE" --no-python \
  "$GSPO_ROOT/launch/rank.sh" "${train_cmd[@]}" "$CONFIG" "${SETS[@]}" "${sets[@]}" &
TRAIN_PID=$!
rc=0; gspo_wait "$TRAIN_PID" || rc=$?
TRAIN_PID=
if (( rc == 0 )); then gspo_log "trainer finished"; else gspo_log "trainer exited $rc (see $GSPO_LOG_DIR)"; fi
exit "$rc"
