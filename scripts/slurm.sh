#!/usr/bin/env bash
# Train on SLURM: one torchrun agent per node, c10d rendezvous on the first node, and a checkpoint
# before the time limit or a preemption; the job requeues itself and resumes from `latest`.
#
#   sbatch --nodes 4 scripts/slurm.sh configs/video.yaml [section.key=value ...]
#
# Time limit: 120 s before it, SLURM sends SIGUSR1 to this script (B: = the batch shell). The trap
# forwards it through srun to torchrun, which passes it to every rank (--signals-to-handle); the ranks
# agree at the next step boundary, save, and exit. Then the job is requeued.
# Preemption: SLURM sends SIGTERM to every process; torchrun passes it on, and the run saves the same
# way within torchrun's grace period (--shutdown-timeout). With --requeue, SLURM requeues the job.
#SBATCH --job-name=tessera
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=tessera-%j.log
set -uo pipefail

CONFIG=${1:?usage: sbatch [--nodes N] scripts/slurm.sh configs/X.yaml [section.key=value ...]}
shift
cd "${SLURM_SUBMIT_DIR:-.}"
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${TESSERA_RDZV_PORT:-29500}
GPUS=${SLURM_GPUS_ON_NODE:-8}
PY=${PYTHON:-python3}
# PyTorch's C++ warnings carry stack frames; when a node is lost the agents would print dozens of them
# around the ranks' `error:` line (the ranks set the same default themselves: parallel/lifecycle/startup.py).
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}

STOPPING=0
forward_stop() {
  echo "[slurm] SIGUSR1: the time limit is near; asking the run to save a checkpoint and stop"
  STOPPING=1
  kill -USR1 "$SRUN_PID" 2>/dev/null
}
trap forward_stop USR1

srun --kill-on-bad-exit=1 "$PY" -m torch.distributed.run \
  --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$GPUS" \
  --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$PORT" --rdzv-id "tessera-$SLURM_JOB_ID" \
  --signals-to-handle SIGTERM,SIGINT,SIGUSR1 \
  train.py --config "$CONFIG" "$@" &
SRUN_PID=$!
# `wait` returns early when the trap runs: wait again until srun has really ended.
while kill -0 "$SRUN_PID" 2>/dev/null; do
  wait "$SRUN_PID"
  CODE=$?
done
wait "$SRUN_PID" 2>/dev/null
CODE=${CODE:-$?}

if [ "$STOPPING" = 1 ]; then
  echo "[slurm] the run stopped with a checkpoint (exit $CODE); requeueing job $SLURM_JOB_ID to resume from latest"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$CODE"
