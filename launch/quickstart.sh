#!/usr/bin/env bash
# The main command: every registered algorithm (cluster.registry.names(), so new ones join by themselves) on
# MNIST-1D (the paper's small CNN, 8 workers on 8 CPU devices) on the shipped cluster profile `commodity_10gbe`
# (one V100 per node on 10 GbE: the kind of cluster the seed papers used; waitless/cluster/profiles/) under a
# heterogeneous cluster: workers 0 and 1 are twice as slow on every micro-batch and, at every iteration, one random
# worker is three calls late (the config's `stragglers=heterogeneous` preset). Same straggler trace, data order
# and seeds for every algorithm. Each algorithm's step size is chosen on 2 tuning seeds and every figure is
# reported on 5 other seeds: medians with 95% bootstrap intervals, the paired probability of beating sync, and a
# verdict (faster / slower / tied). Prints the table (time to target accuracy and loss, final accuracy and loss,
# idle share, staleness, bytes, speed-up over sync) and the path of the plot (loss and accuracy against simulated
# time and steps).
#
# Usage: bash launch/quickstart.sh [WORKDIR] [more experiments.compare flags]
#   default WORKDIR runs/quickstart; rerunning skips finished runs and resumes interrupted ones.
#   SEEDS=N reporting seeds (default 5), TUNING_SEEDS=K (default 2; 0: the step size is chosen on the reported
#   seeds themselves, which the table calls optimistic). The seeds of an algorithm train as replicas of one
#   compiled program, so 7 seeds cost about 2.5x one seed, not 7x.
#   Another cluster: --config.cluster.profile=NAME (a shipped profile, or the JSON `python -m
#   waitless.experiments.calibrate` wrote for yours); the budget follows it (below).
# The flags are in launch/quickstart.flags (benchmarks/quickstart.py times the same command). Every run gets the
# simulated time sync needs for 300 iterations on the profile (--sim_baseline_steps; 0.38 s on commodity_10gbe, 2.8 times what sync needs to reach the target):
# the same time for every algorithm, not the same number of iterations (an asynchronous iteration is one
# gradient, a synchronous one 8), at most 4,500 iterations, evaluated 50 times; each algorithm at the better of
# two step sizes: SGD learning rate 0.2 with momentum 0.9 (the workload's default) or 0.1 without momentum (stale
# gradients with momentum diverge).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
OUT="${1:-runs/quickstart}"
shift $(( $# > 0 ? 1 : 0 ))
python -m waitless.experiments.compare --flagfile=launch/quickstart.flags --workdir="$OUT" \
  --seeds="$(( ${SEEDS:-5} + ${TUNING_SEEDS:-2} ))" --tuning_seeds="${TUNING_SEEDS:-2}" "$@"
