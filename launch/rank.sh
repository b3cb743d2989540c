#!/usr/bin/env bash
# One trainer rank: `launch/rank.sh TRAINER COMMAND...` (srun runs it in the sbatch scripts, torchrun
# in launch/local.sh). Under srun it sets torch.distributed's env:// variables as torchrun would, from
# Slurm's (MASTER_ADDR/MASTER_PORT come from the batch script: the first trainer node, a port derived
# from the job id); under torchrun they are already set. Then it execs the trainer, its output going
# to $GSPO_LOG_DIR/trainer-<node>-r<rank>.log (rank 0 also to the console on local runs).
set -euo pipefail
if [[ $GSPO_MODE != local ]]; then
  export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
  export LOCAL_WORLD_SIZE=$GSPO_PROCS_PER_NODE GROUP_RANK=$SLURM_NODEID
fi
if (( GSPO_GPUS_PER_NODE == 0 )) && [[ -z ${OMP_NUM_THREADS:-} ]]; then
  # CPU run: share the node's cores between its ranks instead of each rank taking all of them.
  threads=$(( ${SLURM_CPUS_ON_NODE:-$(nproc)} / GSPO_PROCS_PER_NODE ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
if [[ -n ${GSPO_LOG_DIR:-} ]]; then
  # One file per rank, named by node and role: no interleaving, nothing lost when a rank is killed.
  log=$GSPO_LOG_DIR/trainer-${SLURMD_NODENAME:-$(hostname -s)}-r$RANK.log
  if [[ $GSPO_MODE == local && $RANK == 0 ]]; then
    exec > >(tee -a "$log") 2>&1
  else
    exec >>"$log" 2>&1
  fi
fi
exec "$@"
