# shellcheck shell=bash
# Shared by launch/local.sh, launch/slurm/submit.sh and the sbatch scripts (sourced, never run).
# Every parameter is a GSPO_* environment variable with the default below; the scripts' --options
# set the same variables. `sbatch` exports the submitting environment, so a variable set at submit
# time reaches every node. docs/launch.md is the user's guide; this file is the reference.
#
#   GSPO_MODE              disaggregated | colocated (SLURM)    local.sh sets 'local' (one machine)
#   GSPO_NODES             nodes in the allocation               2 (sbatch direct: the allocation's)
#   GSPO_SERVER_NODES      disaggregated: nodes running only SGLang servers (the LAST ones of the
#                          node list); the others run trainer ranks      1
#   GSPO_GPUS_PER_NODE     GPUs per node; 0 = CPU run (gloo)     8
#   GSPO_PROCS_PER_NODE    trainer ranks per trainer node        GPUs per node, or 1 when 0 GPUs
#   GSPO_SERVERS_PER_NODE  SGLang servers per server node; each gets GPUs/servers of the node's GPUs;
#                          0 = launch none and pass no URLs (the trainer starts its own)      1
#   GSPO_MODEL_PATH        HF model directory the servers load   (required unless GSPO_SERVER_URLS)
#   GSPO_SERVER_URLS       comma-separated URLs of servers that are already running: none is launched
#                          (use GSPO_SERVER_NODES=0 with it)
#   GSPO_SERVER_PORT       port of the first server; server i (numbered across nodes) uses PORT+i,
#                          so servers never collide even when nodes share an address      30000
#   GSPO_SERVER_HOST       address servers bind                  0.0.0.0 (SLURM), 127.0.0.1 (local)
#   GSPO_SERVER_CMD        server command; the script appends --model-path --host --port
#                          default: python -m rollout.servers.launch (SGLang with the trainer's own flags; on CPU its CPU engine)
#   GSPO_SERVER_ARGS       extra server flags (split on spaces), e.g. "--tp-size 8 --mem-fraction-static 0.5"
#   GSPO_SERVER_TIMEOUT    seconds to wait for every server's /health          900
#   GSPO_TRAIN_CMD         trainer command (split on spaces); CONFIG and --set follow it
#                                                                .venv/bin/gspo-megatron train
#   GSPO_PYTHON            python for the helper checks and servers           .venv/bin/python
#   GSPO_RUN_NAME          run name                              the config file's stem
#   GSPO_RUN_DIR           logs and checkpoints of this run      runs/$GSPO_RUN_NAME
#   GSPO_CHECKPOINT_DIR    passed as checkpoint.dir; the trainer resumes from its `latest`
#                                                                $GSPO_RUN_DIR/checkpoints
#   GSPO_ENV_FILE          a file sourced on the batch node before anything starts (module loads,
#                          NCCL_* settings of your cluster); sbatch steps inherit what it exports
#   GSPO_MASTER_PORT       torch.distributed rendezvous port      derived from the job id and attempt
#   GSPO_STOP_GRACE        seconds the trainer gets after SIGTERM before SIGKILL           60
#   GSPO_MAX_REQUEUES      the job requeues itself (on USR1, or a trainer exit 75: no SGLang
#                          server left) at most this many times                          20
#   GSPO_TRAIN_SRUN_ARGS / GSPO_SERVER_SRUN_ARGS  extra srun flags per role (--container-image, --mpi)
#   NCCL_* / GLOO_* / TORCH_NCCL_*  passed through to every rank as set; NCCL_DEBUG defaults to WARN,
#                          TORCH_NCCL_ASYNC_ERROR_HANDLING to 1; GSPO_NET_IFNAME, when set, fills
#                          NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.

GSPO_RESERVED_KEYS=(checkpoint.dir=GSPO_CHECKPOINT_DIR rollout.server_urls=GSPO_SERVER_URLS)

gspo_log() { printf '[gspo-launch %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
gspo_die() { printf '[gspo-launch] error: %s\n' "$*" >&2; exit 2; }
gspo_uint() { [[ $2 =~ ^[0-9]+$ ]] || gspo_die "$1 must be a whole number >= 0, got '$2'"; }

# gspo_defaults CONFIG: fill every parameter left unset. GSPO_ROOT must be set.
gspo_defaults() {
  local config=$1 stem
  stem=$(basename "$config"); stem=${stem%.*}
  GSPO_MODE=${GSPO_MODE:-disaggregated}
  GSPO_NODES=${GSPO_NODES:-2}
  GSPO_SERVER_NODES=${GSPO_SERVER_NODES:-1}
  GSPO_GPUS_PER_NODE=${GSPO_GPUS_PER_NODE:-8}
  gspo_uint GSPO_GPUS_PER_NODE "$GSPO_GPUS_PER_NODE"
  if (( GSPO_GPUS_PER_NODE > 0 )); then
    GSPO_PROCS_PER_NODE=${GSPO_PROCS_PER_NODE:-$GSPO_GPUS_PER_NODE}
  else
    GSPO_PROCS_PER_NODE=${GSPO_PROCS_PER_NODE:-1}
  fi
  GSPO_SERVERS_PER_NODE=${GSPO_SERVERS_PER_NODE:-1}
  GSPO_MODEL_PATH=${GSPO_MODEL_PATH:-}
  GSPO_SERVER_URLS=${GSPO_SERVER_URLS:-}
  GSPO_SERVER_PORT=${GSPO_SERVER_PORT:-30000}
  GSPO_SERVER_HOST=${GSPO_SERVER_HOST:-0.0.0.0}
  GSPO_SERVER_CMD=${GSPO_SERVER_CMD:-}
  GSPO_SERVER_ARGS=${GSPO_SERVER_ARGS:-}
  GSPO_SERVER_TIMEOUT=${GSPO_SERVER_TIMEOUT:-900}
  GSPO_PYTHON=${GSPO_PYTHON:-$GSPO_ROOT/.venv/bin/python}
  GSPO_TRAIN_CMD=${GSPO_TRAIN_CMD:-$GSPO_ROOT/.venv/bin/gspo-megatron train}
  GSPO_RUN_NAME=${GSPO_RUN_NAME:-$stem}
  GSPO_RUN_DIR=${GSPO_RUN_DIR:-$GSPO_ROOT/runs/$GSPO_RUN_NAME}
  GSPO_CHECKPOINT_DIR=${GSPO_CHECKPOINT_DIR:-$GSPO_RUN_DIR/checkpoints}
  GSPO_ENV_FILE=${GSPO_ENV_FILE:-}
  GSPO_STOP_GRACE=${GSPO_STOP_GRACE:-60}
  GSPO_MAX_REQUEUES=${GSPO_MAX_REQUEUES:-20}
  GSPO_TRAIN_SRUN_ARGS=${GSPO_TRAIN_SRUN_ARGS:-}
  GSPO_SERVER_SRUN_ARGS=${GSPO_SERVER_SRUN_ARGS:-}
  export GSPO_ROOT GSPO_MODE GSPO_NODES GSPO_SERVER_NODES GSPO_GPUS_PER_NODE GSPO_PROCS_PER_NODE \
    GSPO_SERVERS_PER_NODE GSPO_MODEL_PATH GSPO_SERVER_URLS GSPO_SERVER_PORT GSPO_SERVER_HOST \
    GSPO_SERVER_CMD GSPO_SERVER_ARGS GSPO_SERVER_TIMEOUT GSPO_PYTHON GSPO_TRAIN_CMD GSPO_RUN_NAME \
    GSPO_RUN_DIR GSPO_CHECKPOINT_DIR GSPO_ENV_FILE GSPO_STOP_GRACE GSPO_MAX_REQUEUES \
    GSPO_TRAIN_SRUN_ARGS GSPO_SERVER_SRUN_ARGS
}

# Nodes that run trainer ranks / servers, from the parameters (the node list comes later, from Slurm).
gspo_trainer_nodes() {
  if [[ $GSPO_MODE == disaggregated ]]; then echo $(( GSPO_NODES - GSPO_SERVER_NODES )); else echo "$GSPO_NODES"; fi
}
gspo_launches_servers() { [[ -z $GSPO_SERVER_URLS ]] && (( GSPO_SERVERS_PER_NODE > 0 )); }

# gspo_check_inputs CONFIG [--set k=v ...]: everything that can be known before allocating a node.
# Dies with one clear message on the first problem (the config checks report all of theirs at once).
gspo_check_inputs() {
  local config=$1; shift
  local name word trainer_nodes world
  case $GSPO_MODE in disaggregated|colocated|local) ;; *)
    gspo_die "GSPO_MODE must be 'disaggregated' or 'colocated', got '$GSPO_MODE'" ;; esac
  for name in GSPO_NODES GSPO_SERVER_NODES GSPO_GPUS_PER_NODE GSPO_PROCS_PER_NODE \
              GSPO_SERVERS_PER_NODE GSPO_SERVER_PORT GSPO_SERVER_TIMEOUT GSPO_STOP_GRACE GSPO_MAX_REQUEUES; do
    gspo_uint "$name" "${!name}"
  done
  (( GSPO_NODES >= 1 )) || gspo_die "GSPO_NODES must be >= 1, got $GSPO_NODES"
  (( GSPO_PROCS_PER_NODE >= 1 )) || gspo_die "GSPO_PROCS_PER_NODE must be >= 1, got $GSPO_PROCS_PER_NODE"
  [[ $GSPO_MODE != local ]] || (( GSPO_NODES == 1 )) || gspo_die "local runs use one node, got GSPO_NODES=$GSPO_NODES"
  if [[ $GSPO_MODE == disaggregated ]]; then
    if [[ -z $GSPO_SERVER_URLS ]] && (( GSPO_SERVERS_PER_NODE < 1 )); then
      gspo_die "disaggregated mode runs servers on their own nodes: GSPO_SERVERS_PER_NODE must be >= 1, got 0"
    fi
    if gspo_launches_servers && (( GSPO_SERVER_NODES < 1 )); then
      gspo_die "disaggregated mode needs GSPO_SERVER_NODES >= 1 (or GSPO_SERVER_URLS of running servers), got 0"
    fi
    if ! gspo_launches_servers && (( GSPO_SERVER_NODES != 0 )); then
      gspo_die "GSPO_SERVER_URLS is set, so no server is launched: set GSPO_SERVER_NODES=0 (got $GSPO_SERVER_NODES)"
    fi
    (( GSPO_NODES > GSPO_SERVER_NODES )) || gspo_die "node counts do not add up: GSPO_NODES=$GSPO_NODES" \
      "must exceed GSPO_SERVER_NODES=$GSPO_SERVER_NODES to leave at least one trainer node"
  fi
  if (( GSPO_GPUS_PER_NODE > 0 )); then
    (( GSPO_PROCS_PER_NODE <= GSPO_GPUS_PER_NODE )) || gspo_die "GSPO_PROCS_PER_NODE=$GSPO_PROCS_PER_NODE" \
      "trainer ranks per node exceed GSPO_GPUS_PER_NODE=$GSPO_GPUS_PER_NODE (one GPU per rank)"
    (( GSPO_SERVERS_PER_NODE == 0 || GSPO_GPUS_PER_NODE % GSPO_SERVERS_PER_NODE == 0 )) || gspo_die "GSPO_GPUS_PER_NODE=$GSPO_GPUS_PER_NODE" \
      "is not divisible by GSPO_SERVERS_PER_NODE=$GSPO_SERVERS_PER_NODE (each server gets an equal GPU share)"
  fi
  (( GSPO_SERVER_PORT >= 1024 && GSPO_SERVER_PORT + GSPO_NODES * GSPO_SERVERS_PER_NODE <= 65535 )) ||
    gspo_die "GSPO_SERVER_PORT=$GSPO_SERVER_PORT leaves no room for $((GSPO_NODES * GSPO_SERVERS_PER_NODE)) servers below 65536"
  if [[ -n $GSPO_SERVER_URLS ]]; then
    local url
    for url in ${GSPO_SERVER_URLS//,/ }; do
      [[ $url =~ ^https?://[^/:]+:[0-9]+/?$ ]] || gspo_die "GSPO_SERVER_URLS: '$url' is not of the form http://HOST:PORT"
    done
  elif gspo_launches_servers; then
    [[ -n $GSPO_MODEL_PATH ]] || gspo_die "GSPO_MODEL_PATH is not set: the SGLang servers need a model" \
      "directory (or give GSPO_SERVER_URLS of servers already running)"
    [[ -d $GSPO_MODEL_PATH ]] || gspo_die "GSPO_MODEL_PATH=$GSPO_MODEL_PATH is not a directory"
    [[ -r $GSPO_MODEL_PATH/config.json ]] || gspo_die "GSPO_MODEL_PATH=$GSPO_MODEL_PATH has no readable" \
      "config.json (expected a Hugging Face model directory)"
  fi
  [[ -n $config ]] || gspo_die "no config given: expected CONFIG.yaml as the first argument"
  [[ -f $config ]] || gspo_die "config '$config' does not exist (or is not a file)"
  [[ -r $config ]] || gspo_die "config '$config' is not readable"
  [[ -x $GSPO_PYTHON ]] || gspo_die "GSPO_PYTHON=$GSPO_PYTHON is not an executable (build .venv with scripts/setup.sh)"
  read -r word _ <<<"$GSPO_TRAIN_CMD"
  command -v "$word" >/dev/null || gspo_die "GSPO_TRAIN_CMD: '$word' is not an executable command"
  if [[ -n $GSPO_SERVER_CMD ]]; then
    read -r word _ <<<"$GSPO_SERVER_CMD"
    command -v "$word" >/dev/null || gspo_die "GSPO_SERVER_CMD: '$word' is not an executable command"
  fi
  if [[ -n $GSPO_ENV_FILE && ! -r $GSPO_ENV_FILE ]]; then
    gspo_die "GSPO_ENV_FILE=$GSPO_ENV_FILE is not a readable file"
  fi
  local args=() item
  while (( $# )); do
    [[ $1 == --set && $# -ge 2 ]] || gspo_die "unexpected argument '$1': after CONFIG only '--set key=value' pairs"
    args+=(--set "$2"); shift 2
  done
  for item in "${GSPO_RESERVED_KEYS[@]}"; do args+=(--reserved "$item"); done
  trainer_nodes=$(gspo_trainer_nodes)
  world=$(( trainer_nodes * GSPO_PROCS_PER_NODE ))
  local problems
  if ! problems=$("$GSPO_PYTHON" "$GSPO_ROOT/launch/check_config.py" "$config" --world-size "$world" "${args[@]}" 2>&1); then
    gspo_die "config check failed:"$'\n'"$problems"
  fi
  mkdir -p "$GSPO_RUN_DIR/logs" 2>/dev/null || gspo_die "cannot create the run directory $GSPO_RUN_DIR/logs"
  [[ -w $GSPO_RUN_DIR/logs ]] || gspo_die "the run directory $GSPO_RUN_DIR/logs is not writable"
}

# NCCL/gloo knobs: anything the user exported passes through untouched; these are only defaults.
gspo_comm_env() {
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  if [[ -n ${GSPO_NET_IFNAME:-} ]]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GSPO_NET_IFNAME}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$GSPO_NET_IFNAME}
  fi
  export PYTHONUNBUFFERED=1
}

# gspo_wait_healthy TIMEOUT PIDS URL...: poll URL/health until all answer 200. Fails early (exit 1)
# when one of PIDS (comma-separated: the servers' srun, or the servers) dies, and at TIMEOUT.
gspo_wait_healthy() {
  local timeout=$1 pids=$2; shift 2
  "$GSPO_PYTHON" - "$timeout" "$pids" "$@" <<'PY'
import os, sys, time, urllib.request
timeout, pids, urls = float(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
pending, deadline = set(urls), time.monotonic() + timeout
while pending:
    for url in sorted(pending):
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    pending.discard(url)
        except OSError:
            pass
    if not pending:
        break
    if not all(os.path.exists(f"/proc/{pid}") for pid in pids):
        sys.exit(f"[gspo-launch] error: the server processes exited before {sorted(pending)} became healthy (see the server logs)")
    if time.monotonic() > deadline:
        sys.exit(f"[gspo-launch] error: servers {sorted(pending)} not healthy after {timeout:.0f} s (GSPO_SERVER_TIMEOUT; see the server logs)")
    time.sleep(1)
PY
}

# gspo_stop PID [GRACE]: SIGTERM, then SIGKILL after GRACE seconds; quiet when already gone.
gspo_stop() {
  local pid=$1 grace=${2:-$GSPO_STOP_GRACE} t=0
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && (( t < grace * 2 )); do sleep 0.5; t=$((t + 1)); done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# gspo_wait PID: wait for a background child, resuming when a trapped signal interrupts the wait
# while the child still runs; returns the child's exit status.
gspo_wait() {
  local pid=$1 rc
  while :; do
    rc=0; wait "$pid" || rc=$?
    if (( rc > 128 )) && kill -0 "$pid" 2>/dev/null; then continue; fi
    return "$rc"
  done
}
