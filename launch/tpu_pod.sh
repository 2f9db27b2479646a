#!/usr/bin/env bash
# One experiment on a Cloud TPU pod slice: the same command on every TPU VM host (`--worker=all`), joined by
# jax.distributed (the TPU environment gives the coordinator, process count and ids: `--distributed`).
#
# Usage, from the repository root of your workstation:
#   TPU=my-v4-32 ZONE=us-central2-b bash launch/tpu_pod.sh setup        # copy the repo, create the venv
#   TPU=my-v4-32 ZONE=us-central2-b bash launch/tpu_pod.sh run \
#       --config=experiments/configs/imagenet.py:sync,workers=16,devices=16 --workdir=/mnt/shared/runs/in_sync
#   TPU=... ZONE=... bash launch/tpu_pod.sh sync                         # copy the repo again after edits
#
# The config's `devices` must be the slice's device count (`jax.device_count()`, e.g. 16 on a v4-32) and
# `workers` a multiple of it. The workdir must be a filesystem every host mounts (e.g. Filestore / NFS):
# every host writes its shards of each checkpoint there. Rerunning the same `run` resumes from the last
# checkpoint. A host that dies makes the others stop after HEARTBEAT_S (JAX's heartbeats).
# Environment: TPU, ZONE (required), PROJECT (default gcloud's), REMOTE_DIR (default waitless, in the
# hosts' home directories), JAX_VERSION (default the one pinned in requirements.txt), HEARTBEAT_S (default 120).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE to its zone}"
REMOTE_DIR="${REMOTE_DIR:-waitless}"
JAX_VERSION="${JAX_VERSION:-$(sed -n 's/^jax==//p' "$ROOT/requirements.txt")}"
gcloud_tpu=(gcloud compute tpus tpu-vm)
where=("$TPU" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker=all)

on_all_hosts() {  # $1: a bash command line run on every host, in parallel
  "${gcloud_tpu[@]}" ssh "${where[@]}" --command="$1"
}

copy_repo() {
  local archive
  archive="$(mktemp -t waitless.XXXXXX.tar.gz)"
  tar -C "$ROOT" --exclude=./.venv --exclude=./.git --exclude=./runs --exclude='__pycache__' -czf "$archive" .
  "${gcloud_tpu[@]}" scp "$archive" "$TPU:waitless.tar.gz" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} \
    --worker=all
  rm -f "$archive"
  on_all_hosts "mkdir -p $REMOTE_DIR && tar -xzf waitless.tar.gz -C $REMOTE_DIR && rm waitless.tar.gz"
}

command="${1:-}"
shift || true
case "$command" in
  setup)
    copy_repo
    on_all_hosts "cd $REMOTE_DIR && python3 -m venv .venv && . .venv/bin/activate && \
      pip install -q --upgrade pip && grep -v '^jax' requirements.txt | pip install -q -r /dev/stdin && \
      pip install -q 'jax[tpu]==$JAX_VERSION'"
    ;;
  sync)
    copy_repo
    ;;
  run)
    if [ $# -eq 0 ]; then
      echo "usage: $0 run --config=... --workdir=... [experiments.main flags]" >&2
      exit 2
    fi
    flags="$(printf '%q ' "$@")"
    on_all_hosts "cd $REMOTE_DIR && . .venv/bin/activate && export PYTHONPATH=\$PWD TF_CPP_MIN_LOG_LEVEL=2 && \
      python -m waitless.experiments.main $flags --distributed --heartbeat_timeout_s=${HEARTBEAT_S:-120}"
    ;;
  *)
    echo "usage: TPU=NAME ZONE=ZONE $0 setup | sync | run [experiments.main flags...]" >&2
    exit 2
    ;;
esac
