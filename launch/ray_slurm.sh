#!/usr/bin/env bash
# The parameter-server family on a SLURM cluster with Ray (runtime=ray): a Ray head on the first node, a Ray
# worker on every other node, then the driver (experiments.main --ray_address) on the head node.
#
# Usage, from the repository root (the workdir must be on a filesystem the head node sees):
#   sbatch --nodes=2 --gpus-per-node=4 launch/ray_slurm.sh \
#       --config=experiments/configs/cifar10.py:kasync,k=4,runtime=ray,workers=8,ray.worker_gpus=1 \
#       --workdir=/shared/runs/c10_kasync
#   Inside an allocation (salloc): bash launch/ray_slurm.sh --config=... --workdir=...
#
# Each learner actor reserves `ray.worker_gpus` GPUs (1: one GPU per learner; Ray sets CUDA_VISIBLE_DEVICES) and
# `ray.worker_cpus` CPUs; the server actor `ray.server_cpus`. `workers` learners must fit in the job's GPUs.
# Every node needs the same environment (VENV, default $ROOT/.venv with jax[cuda12] and ray installed) and the
# repository at the same path. A learner that dies is restarted by Ray; the driver (SIGTERM 300 s before the time
# limit) checkpoints the server and exits 75, and the job is requeued; the rerun resumes from the checkpoint.
# Environment: VENV, RAY_PORT (default 6379).
#
#SBATCH --job-name=waitless-ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "launch/ray_slurm.sh runs inside a SLURM job: sbatch launch/ray_slurm.sh FLAGS... (or bash it under salloc)" >&2
  exit 2
fi
ROOT="${WAITLESS_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
cd "$ROOT"
# shellcheck disable=SC1091
source "${VENV:-$ROOT/.venv}/bin/activate"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PORT="${RAY_PORT:-6379}"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')"
GPUS="${SLURM_GPUS_ON_NODE:-0}"
CPUS="${SLURM_CPUS_PER_TASK:-1}"

echo "[ray_slurm] head $HEAD ($HEAD_IP:$PORT), ${#NODES[@]} node(s), $GPUS GPU(s) and $CPUS CPU(s) each"
srun --nodes=1 --ntasks=1 -w "$HEAD" ray start --head --node-ip-address="$HEAD_IP" --port="$PORT" \
  --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
sleep 10
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$HEAD_IP:$PORT" --num-cpus="$CPUS" \
    --num-gpus="$GPUS" --block &
done
sleep 10

status=0
python -m waitless.experiments.main --ray_address="$HEAD_IP:$PORT" "$@" &
driver=$!
trap 'kill -TERM "$driver" 2>/dev/null' TERM
wait "$driver" || status=$?
while kill -0 "$driver" 2>/dev/null; do  # a SIGTERM interrupted the wait: the driver is still checkpointing
  status=0
  wait "$driver" || status=$?
done
if [ "$status" = 75 ] && [ "${REQUEUE:-1}" = 1 ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
srun --nodes="${#NODES[@]}" --ntasks="${#NODES[@]}" ray stop --force >/dev/null 2>&1 || true
exit "$status"
