#!/usr/bin/env bash
# N local processes of one experiment on this machine's CPU: a multi-host run (jax.distributed, gloo
# collectives) over loopback, for testing multi-host code paths without a cluster. Each process gets
# devices / N of the config's CPU devices; together they run exactly the single-process experiment.
#
# Usage: bash launch/multiprocess_cpu.sh N [experiments.main flags...]
#   bash launch/multiprocess_cpu.sh 2 --config=experiments/configs/digits.py:sync --workdir=/tmp/digits_2p
#
# Every process gets the same flags plus --coordinator_address=127.0.0.1:PORT --num_processes=N
# --process_id=I, after one `experiments.main --validate_only` has checked the config and flags (a bad one is
# one line, status 2, and no process starts). The script waits for all of them; if one fails (or is killed) it
# stops the others and exits with that process's status, otherwise 0. Rerunning the same command resumes from the last checkpoint.
# Environment: PORT (coordinator port; default a free one), GRACE_S (seconds between SIGTERM and SIGKILL
# for the survivors; default 5), PYTHON (default python of the active venv, else .venv after setup).
set -uo pipefail

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [experiments.main flags...]   (N >= 1 processes)" >&2
  exit 2
fi
N="$1"
shift

# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/active_env.sh" || exit 1
PYTHON="${PYTHON:-python}"
GRACE_S="${GRACE_S:-5}"
PORT="${PORT:-$("$PYTHON" -c 'from waitless.experiments.harness.distributed import free_port; print(free_port())')}" || exit 1
ADDRESS="127.0.0.1:$PORT"

# A bad config or flag: one line, once, before any process starts (each would print it, after seconds of start-up).
"$PYTHON" -m waitless.experiments.main "$@" --num_processes="$N" --validate_only || exit $?

pids=()
declare -A running=()  # process index -> pid, until its exit status is collected
signal_all() {  # $1: signal; only the processes this script started and that are still running, by pid
  local i
  for i in "${!running[@]}"; do
    kill "-$1" "${running[$i]}" 2>/dev/null
  done
}
interrupted=0
kill_at=""
on_signal() {  # Ctrl-C / SIGTERM: SIGINT to every process (each stops like a 1-process run), SIGKILL later
  interrupted=1
  echo "[multiprocess_cpu] interrupted: stopping all $N processes" >&2
  signal_all INT
  kill_at=$((SECONDS + GRACE_S))
}
trap on_signal INT TERM

# Job control: each process in its own process group with SIGINT not ignored (a script's background jobs
# otherwise ignore it), so that Ctrl-C reaches the script and it forwards SIGINT to every process.
set -m
echo "[multiprocess_cpu] $N processes, coordinator $ADDRESS"
for ((i = 0; i < N; i++)); do
  "$PYTHON" -m waitless.experiments.main "$@" --coordinator_address="$ADDRESS" --num_processes="$N" --process_id="$i" &
  pids[i]=$!
  running[$i]=$!
  echo "[multiprocess_cpu] process $i: pid ${pids[$i]}"
done

# Poll rather than `wait -n`: a survivor blocked in a collective with a dead peer ignores SIGTERM (JAX turns
# it into a preemption notice), so it gets SIGKILL after GRACE_S.
status=0
while [ "${#running[@]}" -gt 0 ]; do
  for i in "${!running[@]}"; do
    pid="${running[$i]}"
    state="$(ps -o stat= -p "$pid" 2>/dev/null)"
    if [ -n "$state" ] && [[ "$state" != Z* ]]; then
      continue
    fi
    wait "$pid"
    rc=$?
    unset "running[$i]"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && [ "$interrupted" -eq 0 ]; then
      status=$rc
      reason="exited with status $rc"
      [ "$rc" -gt 128 ] && reason="was killed by signal $((rc - 128)) (status $rc)"
      echo "[multiprocess_cpu] process $i (pid $pid) $reason: stopping the other processes" >&2
      signal_all TERM
      kill_at=$((SECONDS + GRACE_S))
    fi
  done
  if [ -n "$kill_at" ] && [ "$SECONDS" -ge "$kill_at" ] && [ "${#running[@]}" -gt 0 ]; then
    echo "[multiprocess_cpu] ${#running[@]} process(es) still running after ${GRACE_S}s: SIGKILL" >&2
    signal_all KILL
    kill_at=""
  fi
  [ "${#running[@]}" -gt 0 ] && sleep 0.5
done
if [ "$interrupted" -ne 0 ]; then
  echo "[multiprocess_cpu] interrupted; rerun the same command to resume from the last checkpoint" >&2
  exit 130
fi
if [ "$status" -eq 0 ]; then
  echo "[multiprocess_cpu] all $N processes finished"
else
  echo "[multiprocess_cpu] failed (status $status); rerun the same command to resume from the last checkpoint" >&2
fi
exit "$status"
