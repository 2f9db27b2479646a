#!/usr/bin/env bash
# The main command: every registered algorithm (cluster.registry.names(), so new ones join by themselves) on
# MNIST-1D (the paper's small CNN, 8 workers on 8 CPU devices) under a heterogeneous cluster: workers 0 and 1
# are twice as slow on every micro-batch and, at every iteration, one random worker is delayed by 30 ms (the
# config's `stragglers=heterogeneous` preset). Same straggler trace, data order and seeds for every algorithm.
# Each algorithm's step size is chosen on 2 tuning seeds and every figure is reported on 5 other seeds: medians
# with 95% bootstrap intervals, the paired probability of beating sync, and a verdict (faster / slower / tied).
# Prints the table (time to target accuracy and loss, final accuracy and loss, idle share, staleness, bytes,
# speed-up over sync) and the path of the plot (loss and accuracy against simulated time and steps).
#
# Usage: bash launch/quickstart.sh [WORKDIR] [more experiments.compare flags]
#   default WORKDIR runs/quickstart; rerunning skips finished runs and resumes interrupted ones.
#   SEEDS=N reporting seeds (default 5), TUNING_SEEDS=K (default 2; 0: the step size is chosen on the reported
#   seeds themselves, which the table calls optimistic). The seeds of an algorithm train as replicas of one
#   compiled program, so 7 seeds cost about 2.5x one seed, not 7x.
# About 10 minutes on 2 CPU cores after the install (SEEDS=5 TUNING_SEEDS=0: about 7).
# The table's cluster: no profile (10 ms per micro-batch by hand, ideal network; its title says so). Rerun it for
# a named cluster with --config.cluster.profile=NAME (docs/simulator.md#cluster-profiles-cluster); on a fast
# profile the asynchronous entries reach --max_steps before the budget, so raise it or lower --sim_time.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
OUT="${1:-runs/quickstart}"
shift $(( $# > 0 ? 1 : 0 ))
# Every run gets the same 8 simulated seconds (not the same number of iterations: an asynchronous iteration is
# one gradient, a synchronous one 8), at most 4,500 iterations, evaluated 50 times; each algorithm at the better
# of two step sizes: SGD learning rate 0.2 with momentum 0.9 (the workload's default) or 0.1 without momentum
# (stale gradients with momentum diverge).
python -m waitless.experiments.compare \
  --config="experiments/configs/mnist1d.py:sync,stragglers=heterogeneous" \
  --algorithms=all --seeds="$(( ${SEEDS:-5} + ${TUNING_SEEDS:-2} ))" --tuning_seeds="${TUNING_SEEDS:-2}" \
  --workdir="$OUT" \
  --sim_time=8 --max_steps=4500 --sweep=optimizer.learning_rate:optimizer.momentum=0.2:0.9,0.1:0.0 \
  "$@"
