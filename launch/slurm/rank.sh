#!/usr/bin/env bash
# One trainer rank under srun: torch.distributed's env:// variables (as torchrun sets them) from
# Slurm's, then exec the trainer command given as arguments. MASTER_ADDR/MASTER_PORT come from the
# batch script (first trainer node, a port derived from the job id).
set -euo pipefail
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=$GSPO_PROCS_PER_NODE GROUP_RANK=$SLURM_NODEID
if (( GSPO_GPUS_PER_NODE == 0 )) && [[ -z ${OMP_NUM_THREADS:-} ]]; then
  # CPU run: share the node's cores between its ranks instead of each rank taking all of them.
  threads=$(( ${SLURM_CPUS_ON_NODE:-1} / GSPO_PROCS_PER_NODE ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
if [[ -n ${GSPO_LOG_DIR:-} ]]; then
  # One file per rank, named by node and role: no interleaving, nothing lost when a rank is killed.
  exec >>"$GSPO_LOG_DIR/trainer-${SLURMD_NODENAME:-$(hostname -s)}-r$RANK.log" 2>&1
fi
exec "$@"
