#!/usr/bin/env bash
# Submit a GSPO run to SLURM after checking every input (nothing is allocated when a check fails):
#
#   launch/slurm/submit.sh [options] CONFIG.yaml [--set key=value ...] [-- extra sbatch flags]
#
#   --mode disaggregated|colocated  GSPO_MODE          servers on their own nodes | on every node
#   --nodes N                       GSPO_NODES          total nodes                              (2)
#   --server-nodes S                GSPO_SERVER_NODES   disaggregated: server-only nodes          (1)
#   --gpus-per-node G               GSPO_GPUS_PER_NODE  0 = CPU run with gloo                    (8)
#   --procs-per-node P              GSPO_PROCS_PER_NODE trainer ranks per trainer node  (G, or 1 on CPU)
#   --servers-per-node K            GSPO_SERVERS_PER_NODE                                        (1)
#   --model-path DIR                GSPO_MODEL_PATH     HF model directory for the SGLang servers
#   --server-urls URL,URL           GSPO_SERVER_URLS    use running servers instead (with --server-nodes 0)
#   --run-dir DIR                   GSPO_RUN_DIR        logs + checkpoints      (runs/<config stem>)
#   --time T / --partition P / --account A / --job-name J   passed to sbatch
#   --signal-lead SECONDS           GSPO_SIGNAL_LEAD    USR1 this long before the time limit     (300)
#   --wait                          sbatch --wait: return when the job ends, with its exit code
#   --dry-run                       check, print the sbatch command, submit nothing
#
# Every other parameter (GSPO_TRAIN_CMD, GSPO_SERVER_ARGS, GSPO_ENV_FILE, NCCL_* ...) is an
# environment variable: launch/common.sh lists them all. sbatch exports this environment to the job.
# Resubmitting with the same run directory resumes the run from its latest checkpoint.
set -euo pipefail
GSPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export GSPO_ROOT
# shellcheck source=../common.sh
source "$GSPO_ROOT/launch/common.sh"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
need() { (( $# >= 2 )) && [[ -n $2 ]] || gspo_die "option $1 needs a value"; }

WAIT=0 DRY=0 SBATCH_EXTRA=() CONFIG= SETS=()
while (( $# )); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --mode) need "$@"; GSPO_MODE=$2; shift 2 ;;
    --nodes) need "$@"; GSPO_NODES=$2; shift 2 ;;
    --server-nodes) need "$@"; GSPO_SERVER_NODES=$2; shift 2 ;;
    --gpus-per-node) need "$@"; GSPO_GPUS_PER_NODE=$2; shift 2 ;;
    --procs-per-node) need "$@"; GSPO_PROCS_PER_NODE=$2; shift 2 ;;
    --servers-per-node) need "$@"; GSPO_SERVERS_PER_NODE=$2; shift 2 ;;
    --model-path) need "$@"; GSPO_MODEL_PATH=$2; shift 2 ;;
    --server-urls) need "$@"; GSPO_SERVER_URLS=$2; shift 2 ;;
    --run-dir) need "$@"; GSPO_RUN_DIR=$2; shift 2 ;;
    --signal-lead) need "$@"; GSPO_SIGNAL_LEAD=$2; shift 2 ;;
    --time|--partition|--account|--job-name) need "$@"; SBATCH_EXTRA+=("$1=$2"); shift 2 ;;
    --wait) WAIT=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --set) need "$@"; SETS+=(--set "$2"); shift 2 ;;
    --) shift; SBATCH_EXTRA+=("$@"); break ;;
    -*) gspo_die "unknown option '$1' (see --help)" ;;
    *) [[ -z $CONFIG ]] || gspo_die "a second config '$1' after '$CONFIG': give one CONFIG.yaml"; CONFIG=$1; shift ;;
  esac
done
[[ -n $CONFIG ]] || gspo_die "no config given (usage: launch/slurm/submit.sh [options] CONFIG.yaml [--set k=v ...])"
(( DRY )) || command -v sbatch >/dev/null || gspo_die "sbatch is not on PATH: run this on a SLURM login node"

# Paths the job will see: absolute (the job may start in another directory).
CONFIG=$(realpath -m "$CONFIG")
[[ -z ${GSPO_MODEL_PATH:-} ]] || GSPO_MODEL_PATH=$(realpath -m "$GSPO_MODEL_PATH")
[[ -z ${GSPO_RUN_DIR:-} ]] || GSPO_RUN_DIR=$(realpath -m "$GSPO_RUN_DIR")
[[ -z ${GSPO_ENV_FILE:-} ]] || GSPO_ENV_FILE=$(realpath -m "$GSPO_ENV_FILE")
gspo_defaults "$CONFIG"
GSPO_SIGNAL_LEAD=${GSPO_SIGNAL_LEAD:-300}
gspo_uint GSPO_SIGNAL_LEAD "$GSPO_SIGNAL_LEAD"
gspo_check_inputs "$CONFIG" "${SETS[@]}"

cmd=(sbatch --nodes="$GSPO_NODES" --job-name="gspo-$GSPO_RUN_NAME" --requeue --open-mode=append
     --signal="B:USR1@$GSPO_SIGNAL_LEAD" --output="$GSPO_RUN_DIR/logs/slurm-%j.out" --chdir="$GSPO_ROOT")
(( GSPO_GPUS_PER_NODE > 0 )) && cmd+=(--gpus-per-node="$GSPO_GPUS_PER_NODE")
(( WAIT )) && cmd+=(--wait)
cmd+=("${SBATCH_EXTRA[@]}" "$GSPO_ROOT/launch/slurm/$GSPO_MODE.sbatch" "$CONFIG" "${SETS[@]}")
gspo_log "inputs OK: $GSPO_MODE, $GSPO_NODES node(s), $GSPO_GPUS_PER_NODE GPU(s)/node, run dir $GSPO_RUN_DIR"
if (( DRY )); then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
