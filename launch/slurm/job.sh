# shellcheck shell=bash
# The body of launch/slurm/{disaggregated,colocated}.sbatch (sourced by them with GSPO_MODE set).
# Runs on the allocation's first node: checks, then servers, then trainer ranks, then waits.
#
# Roles:  disaggregated  the first GSPO_NODES - GSPO_SERVER_NODES nodes run trainer ranks, the last
#                        GSPO_SERVER_NODES run SGLang servers only
#         colocated      every node runs GSPO_SERVERS_PER_NODE servers and GSPO_PROCS_PER_NODE ranks
# Logs:   $GSPO_RUN_DIR/logs/<job id>.<attempt>/trainer-<node>-r<rank>.log and server-<node>-s<i>.log
#         (one file per process, named by role and node); this script's own log, with srun's
#         messages, is the sbatch --output ($GSPO_RUN_DIR/logs/slurm-<job id>.out from submit.sh)
# Resume: checkpoint.dir is the same on every attempt; the trainer resumes from its `latest`.
# Preemption: USR1 (sent GSPO's signal lead before the time limit, `#SBATCH --signal=B:USR1@...`, or
#         by `scancel --signal=USR1 --batch JOB`) stops the steps (SIGTERM, GSPO_STOP_GRACE) and
#         requeues the job; SIGTERM (scancel, preemption, `scontrol requeue`) stops the steps and
#         exits, and Slurm requeues the job when that is why it ended (--requeue).
set -uo pipefail

[[ -n ${SLURM_JOB_ID:-} ]] || { echo "[gspo-launch] error: this is a Slurm batch script: submit it with" \
  "sbatch or launch/slurm/submit.sh, do not run it with bash" >&2; exit 2; }
# shellcheck source=../common.sh
source "$GSPO_ROOT/launch/common.sh"

(( $# >= 1 )) || gspo_die "usage: sbatch [--nodes N ...] launch/slurm/$GSPO_MODE.sbatch CONFIG.yaml [--set key=value ...]"
CONFIG=$1; shift
if [[ -n ${GSPO_ENV_FILE:-} ]]; then
  [[ -r $GSPO_ENV_FILE ]] || gspo_die "GSPO_ENV_FILE=$GSPO_ENV_FILE is not a readable file"
  # shellcheck disable=SC1090
  source "$GSPO_ENV_FILE"
fi
# Submitted with plain sbatch: the allocation's shape is the default.
ALLOC_GPUS=${SLURM_GPUS_PER_NODE:-}; ALLOC_GPUS=${ALLOC_GPUS##*:}  # "h100:8" -> 8
GSPO_NODES=${GSPO_NODES:-$SLURM_JOB_NUM_NODES}
GSPO_GPUS_PER_NODE=${GSPO_GPUS_PER_NODE:-${ALLOC_GPUS:-8}}
gspo_defaults "$CONFIG"
gspo_check_inputs "$CONFIG" "$@"
(( SLURM_JOB_NUM_NODES == GSPO_NODES )) || gspo_die "node counts do not add up: the allocation has" \
  "$SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) but GSPO_NODES=$GSPO_NODES"
if [[ -n $ALLOC_GPUS ]] && (( ALLOC_GPUS != GSPO_GPUS_PER_NODE )); then
  gspo_die "GPU counts do not add up: the allocation has $ALLOC_GPUS GPUs per node but GSPO_GPUS_PER_NODE=$GSPO_GPUS_PER_NODE"
fi
gspo_comm_env

ATTEMPT=${SLURM_RESTART_COUNT:-0}
export GSPO_LOG_DIR=$GSPO_RUN_DIR/logs/$SLURM_JOB_ID.$ATTEMPT
mkdir -p "$GSPO_LOG_DIR" "$GSPO_CHECKPOINT_DIR"
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#HOSTS[@]} == GSPO_NODES )) || gspo_die "scontrol listed ${#HOSTS[@]} hosts for $SLURM_JOB_NODELIST, expected $GSPO_NODES"
N_TRAIN=$(gspo_trainer_nodes)
TRAIN_HOSTS=("${HOSTS[@]:0:N_TRAIN}")
if [[ $GSPO_MODE == disaggregated ]]; then SERVER_HOSTS=("${HOSTS[@]:N_TRAIN}"); else SERVER_HOSTS=("${HOSTS[@]}"); fi
gspo_launches_servers || SERVER_HOSTS=()

# Server URLs in srun's block order: server i (node j, k-th on it) is PORT + i, reached by node name.
URLS=()
if gspo_launches_servers; then
  i=0
  for host in "${SERVER_HOSTS[@]}"; do
    for (( k = 0; k < GSPO_SERVERS_PER_NODE; k++, i++ )); do URLS+=("http://$host:$(( GSPO_SERVER_PORT + i ))"); done
  done
else
  IFS=, read -ra URLS <<<"$GSPO_SERVER_URLS"
fi

export MASTER_ADDR=${TRAIN_HOSTS[0]}
export MASTER_PORT=${GSPO_MASTER_PORT:-$(( 20000 + (SLURM_JOB_ID * 7 + ATTEMPT) % 20000 ))}
WORLD=$(( N_TRAIN * GSPO_PROCS_PER_NODE ))
CPUS_PER_RANK=$(( ${SLURM_CPUS_ON_NODE:-1} / GSPO_PROCS_PER_NODE )); (( CPUS_PER_RANK >= 1 )) || CPUS_PER_RANK=1

gspo_log "job $SLURM_JOB_ID attempt $ATTEMPT, mode $GSPO_MODE, nodes ${HOSTS[*]}"
gspo_log "trainer: ${TRAIN_HOSTS[*]} x $GSPO_PROCS_PER_NODE ranks = world $WORLD, rendezvous $MASTER_ADDR:$MASTER_PORT," \
  "GPUs/node $GSPO_GPUS_PER_NODE ($([[ $GSPO_GPUS_PER_NODE == 0 ]] && echo gloo, CPU || echo NCCL))"
gspo_log "servers: ${URLS[*]:-none}"
gspo_log "run dir $GSPO_RUN_DIR, logs $GSPO_LOG_DIR"
if [[ -e $GSPO_CHECKPOINT_DIR/latest ]]; then
  gspo_log "checkpoint dir $GSPO_CHECKPOINT_DIR has 'latest': the trainer resumes from it"
else
  gspo_log "checkpoint dir $GSPO_CHECKPOINT_DIR has no 'latest': the trainer starts fresh"
fi
gspo_log "comm env: $(env | grep -E '^(NCCL|GLOO|TORCH_NCCL)_' | sort | tr '\n' ' ')"

# stop_step NAME SRUN_PID GRACE: SIGTERM to the step's tasks (scancel: srun itself would turn a
# SIGTERM into SIGKILL), up to GRACE seconds to exit (a trainer may checkpoint), then end the srun.
stop_step() {
  local name=$1 pid=$2 grace=$3 step t=0
  kill -0 "$pid" 2>/dev/null || return 0
  step=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$name" '$2 == n {print $1}')
  [[ -n $step ]] && scancel --signal=TERM "$step" 2>/dev/null
  while kill -0 "$pid" 2>/dev/null && (( t < grace * 2 )); do sleep 0.5; t=$((t + 1)); done
  gspo_stop "$pid" 10
}
SERVER_PID= TRAIN_PID=
stop_steps() {
  [[ -n $TRAIN_PID ]] && stop_step trainer "$TRAIN_PID" "$GSPO_STOP_GRACE"
  [[ -n $SERVER_PID ]] && stop_step server "$SERVER_PID" 30
  TRAIN_PID= SERVER_PID=
}
on_usr1() {
  trap '' USR1
  if (( ATTEMPT >= GSPO_MAX_REQUEUES )); then
    gspo_log "USR1: already requeued $ATTEMPT times (GSPO_MAX_REQUEUES): not requeueing; the run goes on until the time limit"
    return
  fi
  gspo_log "USR1 (time limit near or preemption notice): stopping the steps, then requeueing job $SLURM_JOB_ID"
  trap '' TERM  # the requeue below sends TERM to this script: nothing more to do by then
  stop_steps
  if scontrol requeue "$SLURM_JOB_ID"; then
    gspo_log "requeued: the next attempt resumes from $GSPO_CHECKPOINT_DIR/latest"
    exit 0
  fi
  gspo_log "error: scontrol requeue $SLURM_JOB_ID failed (was the job submitted with --requeue?)"
  exit 1
}
on_term() {
  trap '' TERM USR1
  gspo_log "SIGTERM (cancel, preemption or requeue): stopping the steps"
  stop_steps
  exit 143
}
trap on_usr1 USR1
trap on_term TERM
trap stop_steps EXIT

if gspo_launches_servers; then
  read -ra server_srun <<<"$GSPO_SERVER_SRUN_ARGS"
  srun --overlap --kill-on-bad-exit=1 --distribution=block \
    --nodes=${#SERVER_HOSTS[@]} --nodelist="$(IFS=,; echo "${SERVER_HOSTS[*]}")" \
    --ntasks-per-node="$GSPO_SERVERS_PER_NODE" --ntasks=$(( ${#SERVER_HOSTS[@]} * GSPO_SERVERS_PER_NODE )) \
    --job-name=server "${server_srun[@]}" \
    "$GSPO_ROOT/launch/server.sh" &
  SERVER_PID=$!
  gspo_log "waiting up to $GSPO_SERVER_TIMEOUT s for ${#URLS[@]} server(s) to be healthy"
  gspo_wait_healthy "$GSPO_SERVER_TIMEOUT" "$SERVER_PID" "${URLS[@]}" || exit 1
  gspo_log "servers healthy"
fi

rm -f "$GSPO_CHECKPOINT_DIR/NO_SERVER_LEFT"  # (left by an earlier attempt: see the end)
read -ra train_cmd <<<"$GSPO_TRAIN_CMD"
read -ra train_srun <<<"$GSPO_TRAIN_SRUN_ARGS"
sets=(--set "checkpoint.dir=$GSPO_CHECKPOINT_DIR")
(( ${#URLS[@]} )) && sets+=(--set "rollout.server_urls=[$(IFS=,; echo "${URLS[*]}")]")
gspo_log "trainer: ${train_cmd[*]} $CONFIG $* ${sets[*]}"
srun --overlap --kill-on-bad-exit=1 --distribution=block \
  --nodes="$N_TRAIN" --nodelist="$(IFS=,; echo "${TRAIN_HOSTS[*]}")" \
  --ntasks-per-node="$GSPO_PROCS_PER_NODE" --ntasks="$WORLD" --cpus-per-task="$CPUS_PER_RANK" \
  --job-name=trainer "${train_srun[@]}" \
  "$GSPO_ROOT/launch/rank.sh" "${train_cmd[@]}" "$CONFIG" "$@" "${sets[@]}" &
TRAIN_PID=$!
gspo_wait "$TRAIN_PID"; rc=$?
TRAIN_PID=
if (( rc == 0 )); then gspo_log "trainer finished"; else gspo_log "trainer exited $rc (see $GSPO_LOG_DIR/trainer-*.log)"; fi
stop_steps
# 75 (rollout.servers.health.EXIT_NO_SERVER): no SGLang server came back within rollout.server_wait_s,
# after a checkpoint. Retryable: a new allocation gets new nodes and servers. Rank 0 leaves
# NO_SERVER_LEFT in the checkpoint folder first: srun --kill-on-bad-exit may have reported another
# code (rank 0 SIGKILLed once the other ranks had exited 75).
if (( rc != 0 )) && [[ -f $GSPO_CHECKPOINT_DIR/NO_SERVER_LEFT ]] && (( ATTEMPT < GSPO_MAX_REQUEUES )); then
  rm -f "$GSPO_CHECKPOINT_DIR/NO_SERVER_LEFT"
  trap '' TERM  # the requeue sends TERM to this script
  if scontrol requeue "$SLURM_JOB_ID"; then
    gspo_log "no SGLang server left: requeued; the next attempt resumes from $GSPO_CHECKPOINT_DIR/latest"
    exit 0
  fi
fi
exit "$rc"
