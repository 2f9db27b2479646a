#!/usr/bin/env bash
# One experiment on a SLURM GPU cluster: one process per node (all its GPUs) or one process per GPU, joined by
# jax.distributed (SLURM's environment gives the coordinator, process count and ids: `--distributed`).
#
# Usage, from the repository root (the workdir must be on a filesystem every node sees):
#   sbatch --nodes=2 --gpus-per-node=4 launch/slurm.sh \
#       --config=experiments/configs/cifar10.py:sync,workers=8,devices=8 --workdir=/shared/runs/c10_sync
#   One process per GPU instead of per node:
#   sbatch --nodes=2 --gpus-per-node=4 --ntasks-per-node=4 launch/slurm.sh --config=... --workdir=...
#   Inside an allocation (salloc): bash launch/slurm.sh --config=... --workdir=...
#
# The config's `devices` must be the job's GPU count (nodes x GPUs per node) and `workers` a multiple of it.
# Preemption and the time limit: SLURM sends SIGTERM 300 s ahead (`--signal=B:TERM@300`, to this script); it
# is passed to every process, which finishes its block, checkpoints and exits with status 75; the job is then
# requeued (`--requeue`, or REQUEUE=0 to stop instead) and the rerun resumes from that checkpoint exactly.
# A job that stops otherwise (failure, `scancel`) resumes from its last checkpoint when submitted again. One process that dies makes SLURM end the others
# (`srun --kill-on-bad-exit`); JAX's heartbeats stop them too if SLURM does not (HEARTBEAT_S).
# Per-GPU mode: do not bind GPUs per task (no --gpus-per-task / --gpu-bind): every process sees the node's
# GPUs and JAX gives process SLURM_LOCALID its GPU.
# Environment: VENV (default $ROOT/.venv, with jax[cuda12] installed), HEARTBEAT_S (default 120),
# JAX_COORDINATOR_PORT (default derived from the job id by JAX).
#
#SBATCH --job-name=waitless
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
  echo "launch/slurm.sh runs inside a SLURM job: sbatch launch/slurm.sh FLAGS... (or bash it under salloc)" >&2
  exit 2
fi
# sbatch runs a copy of this script from its spool directory: the repository is where the job was submitted.
ROOT="${WAITLESS_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
cd "$ROOT"
if [ ! -f experiments/main.py ]; then
  echo "no experiments/main.py in $ROOT: submit from the repository root or set WAITLESS_ROOT" >&2
  exit 2
fi
VENV="${VENV:-$ROOT/.venv}"
# shellcheck disable=SC1091
[ -f "$VENV/bin/activate" ] && source "$VENV/bin/activate"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
tasks="${SLURM_NTASKS:-$nodes}"
tasks_per_node=$((tasks / nodes))
gpus_per_node="${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
if [ "$gpus_per_node" -lt 1 ]; then
  echo "no GPU visible on $(hostname): request them (--gpus-per-node=G)" >&2
  exit 2
fi
if [ "$tasks_per_node" -eq 1 ]; then
  # One process per node drives all its GPUs (JAX's SLURM detection would otherwise give it one GPU).
  JAX_LOCAL_DEVICE_IDS="$(seq -s, 0 $((gpus_per_node - 1)))"
  export JAX_LOCAL_DEVICE_IDS
  mode="one process per node, $gpus_per_node GPU(s) each"
elif [ "$tasks_per_node" -eq "$gpus_per_node" ]; then
  mode="one process per GPU"  # JAX's SLURM detection: process SLURM_LOCALID uses GPU SLURM_LOCALID
else
  echo "$tasks_per_node tasks per node with $gpus_per_node GPUs per node: use --ntasks-per-node=1" \
       "(one process per node) or --ntasks-per-node=$gpus_per_node (one per GPU)" >&2
  exit 2
fi
echo "[slurm] job $SLURM_JOB_ID: $nodes node(s), $tasks process(es), $mode, $((nodes * gpus_per_node)) GPU(s)"

srun --kill-on-bad-exit=1 --ntasks="$tasks" --ntasks-per-node="$tasks_per_node" \
  python -m waitless.experiments.main "$@" --distributed --heartbeat_timeout_s="${HEARTBEAT_S:-120}" &
run=$!
# SLURM signals the batch script (B:), not srun's tasks: forward it, then requeue once they checkpointed.
trap 'echo "[slurm] SIGTERM: asking every process to checkpoint"; kill -TERM "$run" 2>/dev/null || true' TERM
status=0
wait "$run" || status=$?
if [ "$status" -ne 0 ] && kill -0 "$run" 2>/dev/null; then  # wait returned early on the trapped signal
  status=0
  wait "$run" || status=$?
fi
if [ "$status" -eq 75 ] && [ "${REQUEUE:-1}" = "1" ]; then
  echo "[slurm] preempted and checkpointed: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
