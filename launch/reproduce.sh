#!/usr/bin/env bash
# Every comparison of the results pages (docs/results/), one `experiments.compare` command per table, each seed a
# replica of one compiled program per entry (so 5 seeds cost about 2x one, not 5x). Each writes comparison.md /
# .json / .png under WORKDIR/<table>; the pages quote those files and show those figures. Rerunning skips
# finished runs and resumes the rest.
#
# Usage: bash launch/reproduce.sh [WORKDIR] [TABLE ...]
#   WORKDIR default runs/reproduce; TABLE one or more of the names below (default: all, about 45 minutes on
#   2 CPU cores). SEEDS=N (default 5) reporting seeds; tables with a step-size sweep tune it on 2 more seeds
#   (TUNING_SEEDS) and report on the other N.
# PROFILE=NAME (a shipped cluster profile or a profile JSON's path) runs the tables on that cluster
#   (docs/simulator.md#cluster-profiles-cluster): the profile's compute, per-call overhead, collectives and host
#   time replace each table's hand-set cluster (its 10 ms calls, its network, its overhead), and each table keeps
#   its stragglers' shape (slow factors, delays in calls, the distribution of compute times, rescaled to the
#   profile's mean call); every table's title names its profile. A --sim_time budget becomes the time the
#   table's baseline needs on the profile for the iterations it makes in that budget without one
#   (--sim_baseline_steps). The tables that only vary the hand-set cost (*_net, *_overhead, lap_sgd_overhead*)
#   are the same table on a profile and are left out of the default list.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
OUT="${1:-runs/reproduce}"
shift $(( $# > 0 ? 1 : 0 ))
SEEDS="${SEEDS:-5}"
TUNING="${TUNING_SEEDS:-2}"
TABLES=("$@")
if [ ${#TABLES[@]} -eq 0 ] && [ -n "${PROFILE:-}" ]; then
  TABLES=(nonblocking_slow nonblocking_random lap_sgd dasgd wagma wagma_constant wagma_noise2 wagma_noise20
          stale_tradeoff ringmaster diloco)
fi
[ ${#TABLES[@]} -gt 0 ] || TABLES=(nonblocking_slow nonblocking_slow_net nonblocking_random nonblocking_random_net
                                   nonblocking_slow_overhead nonblocking_random_overhead lap_sgd lap_sgd_overhead lap_sgd_overhead90 dasgd wagma wagma_constant wagma_noise2 wagma_noise20 stale_tradeoff
                                   ringmaster diloco)

compare() {  # compare TABLE FLAGS...: one table, in WORKDIR/TABLE
  local table="$1"; shift
  echo "[reproduce] $table"
  python -m waitless.experiments.compare --workdir="$OUT/$table" "$@" ${PROFILE:+--config.cluster.profile="$PROFILE"}
}
swept() { echo "--seeds=$((SEEDS + TUNING)) --tuning_seeds=$TUNING"; }
# budget SECONDS STEPS: --sim_time=SECONDS without a profile; on one, the time the table's baseline needs there for
# STEPS iterations, the iterations it makes in SECONDS without a profile (sim_budget.steps_for_sim_time).
budget() { if [ -n "${PROFILE:-}" ]; then echo "--sim_baseline_steps=$2"; else echo "--sim_time=$1"; fi; }
# hand_set ARGS...: a table's hand-set cluster (network, per-call overhead, the compute of a call), its arguments
# without a profile, nothing on one (the profile gives them).
hand_set() { [ -n "${PROFILE:-}" ] || printf '%s\n' "$@"; }

# Section 1, non-blocking SGD: digits, 8 workers, learning rate 0.05 for all; (a) workers 0 and 1 four times
# slower, (b) shifted-exponential batch times; each on an ideal network and on a slow alpha_beta one.
NB_ENTRIES='sync;dpsgd;dpsgd,order=overlap;nonblocking;nonblocking,topology=ring'
NB_ENTRIES+=';matcha'  # MATCHA (budget 0.5): the decentralized baseline of the non-blocking SGD paper
NB_M4='nonblocking,microbatches=4,MICRO;nonblocking,topology=ring,microbatches=4,MICRO'
SLOW=(--config.stragglers.slow_workers='(0,1)' --config.stragglers.slow_factor=4.0)
RANDOM_TIMES=(--config.stragglers.kind=shifted_exponential --config.stragglers.shift_s=0.005 --config.stragglers.rate=100.0)
NET=(--config.network.kind=alpha_beta --config.network.latency_s=1e-4 --config.network.bandwidth_gbps=0.1)
slow_m4="${NB_M4//MICRO/stragglers.base_s=0.0025}"
random_m4="${NB_M4//MICRO/stragglers.shift_s=0.00125,stragglers.rate=400.0}"
random_controls='sync,microbatches=4,stragglers.shift_s=0.00125,stragglers.rate=400.0;dpsgd,order=overlap,microbatches=4,stragglers.shift_s=0.00125,stragglers.rate=400.0'
if [ -n "${PROFILE:-}" ]; then  # a micro-batch of b / 4 samples costs what the profile says, not a quarter of 10 ms
  slow_m4="${NB_M4//,MICRO/}"
  random_m4="$slow_m4"
  random_controls='sync,microbatches=4;dpsgd,order=overlap,microbatches=4'
  # The shape of (b): the default shift 5 ms and rate 100/s, a third of the mean fixed; the profile sets the mean.
  RANDOM_TIMES=(--config.stragglers.kind=shifted_exponential)
fi
# With a per-call overhead (stragglers.overhead_s): half of a 16-sample batch's 10 ms is the call's overhead,
# the low end of the share `python -m benchmarks.call_overhead` measures for the MNIST-1D CNN at its batch
# (0.43-0.71 on 2 CPU cores; the digits MLP itself: 0.89-0.98). m = 1 entries cost what they cost above (5 + 5 ms per batch); an
# m = 4 micro-batch costs 5 + 1.25 ms, so its batch 25 ms. Entries as above: they take OVERHEAD's flags.
OVERHEAD=(--config.stragglers.overhead_s=0.005 --config.stragglers.base_s=0.005)
overhead_m4="${NB_M4//MICRO/stragglers.base_s=0.00125}"
# Random times with the 5 ms shift as the overhead: a batch 5 ms + Exp(mean 10 ms) as in (b), the same draws;
# an m = 4 micro-batch 5 ms + Exp(mean 2.5 ms).
RANDOM_OVERHEAD=(--config.stragglers.kind=exponential --config.stragglers.rate=100.0 --config.stragglers.overhead_s=0.005)
random_overhead_m4="${NB_M4//MICRO/stragglers.rate=400.0}"
random_overhead_controls='sync,microbatches=4,stragglers.rate=400.0;dpsgd,order=overlap,microbatches=4,stragglers.rate=400.0'
with_activation() { echo "${1//nonblocking/nonblocking,activation_latency_s=1e-4}"; }
nonblocking() {  # nonblocking TABLE SIM_TIME SYNC_STEPS ENTRIES FLAGS...
  local table="$1" sim_time="$2" steps="$3" entries="$4"; shift 4
  compare "$table" --config=experiments/configs/digits.py:sync --seeds="$SEEDS" "$(budget "$sim_time" "$steps")" \
    --evals=40 --algorithms="$entries" "$@"
}

for table in "${TABLES[@]}"; do
  case "$table" in
    # (the second number: the iterations sync makes in the first without a profile)
    nonblocking_slow) nonblocking "$table" 3 75 "$NB_ENTRIES;$slow_m4" "${SLOW[@]}" ;;
    nonblocking_slow_net) nonblocking "$table" 3.5 75 "$(with_activation "$NB_ENTRIES;$slow_m4")" "${SLOW[@]}" "${NET[@]}" ;;
    nonblocking_random) nonblocking "$table" 2.5 71 "$NB_ENTRIES;$random_m4;$random_controls" "${RANDOM_TIMES[@]}" ;;
    nonblocking_random_net)
      nonblocking "$table" 3 72 "$(with_activation "$NB_ENTRIES;$random_m4");$random_controls" "${RANDOM_TIMES[@]}" \
        "${NET[@]}" ;;
    nonblocking_slow_overhead) nonblocking "$table" 3 75 "$NB_ENTRIES;$overhead_m4" "${SLOW[@]}" "${OVERHEAD[@]}" ;;
    nonblocking_random_overhead)
      nonblocking "$table" 2.5 71 "$NB_ENTRIES;$random_overhead_m4;$random_overhead_controls" "${RANDOM_OVERHEAD[@]}" ;;
    # Section 2, LAP-SGD / LPP-SGD: digits, a slow network on which the average takes 4.09 node updates; the
    # verdicts against local SGD (the paper's claim is against it and sync; sync is the slower of the two).
    # lap_sgd_overhead: the same with OVERHEAD (a local-SGD step still 10 ms; Q = 4 threads share each call's
    # 5 ms: 6.25 ms per node update), where a small batch leaves the accelerator idle (the paper's argument);
    # lap_sgd_overhead90: the share measured for the digits MLP itself, 9 of the 10 ms (3.25 ms per update).
    lap_sgd|lap_sgd_overhead|lap_sgd_overhead90)
      case "$table" in
        lap_sgd) flags=() ;;
        lap_sgd_overhead) mapfile -t flags < <(hand_set "${OVERHEAD[@]}") ;;
        *) mapfile -t flags < <(hand_set --config.stragglers.overhead_s=0.009 --config.stragglers.base_s=0.001) ;;
      esac
      # shellcheck disable=SC2046
      compare "$table" --config=experiments/configs/digits.py --seeds="$SEEDS" \
        --algorithms='sync;local_sgd,local_steps=8;lap_sgd,threads=1,local_steps=8;lap_sgd,threads=4,local_steps=8;lpp_sgd,threads=4,local_steps=8,prepass_steps=10,partial_cost=0.5;lpp_sgd,threads=4,local_steps=8,prepass_steps=50,partial_cost=0.5;lpp_sgd,threads=4,local_steps=8,prepass_steps=10,partial_cost=1.0' \
        $(hand_set --config.network.kind=alpha_beta --config.network.latency_s=1e-3 --config.network.bandwidth_gbps=0.02) \
        --config.target_accuracy=0.9 --config.eval_every=10 --baseline='local_sgd,local_steps=8' ${flags[@]+"${flags[@]}"} ;;
    # Section 3, DaSGD: digits, the all-reduce takes 2.83 local steps; the verdicts against local SGD.
    dasgd)
      # shellcheck disable=SC2046
      compare "$table" --config=experiments/configs/digits.py --seeds="$SEEDS" \
        --algorithms='sync;local_sgd,local_steps=4;dasgd,local_steps=4,delay=1;dasgd,local_steps=4,delay=3;dasgd,local_steps=4,delay=3,correction=mix' \
        $(hand_set --config.network.kind=alpha_beta --config.network.latency_s=1e-4 --config.network.bandwidth_gbps=0.02) \
        --config.target_accuracy=0.96 --config.eval_every=10 --baseline='local_sgd,local_steps=4' ;;
    # Section 4, WAGMA-SGD: 16 workers on 8 devices, lognormal compute, 2 random workers delayed 30 ms (three calls;
    # on a profile three of its calls). `wagma` is the authors' rule (the default); `wagma,rule=step_then_average`
    # the step-then-average option.
    wagma)
      delay='stragglers.delay_s=0.03'
      [ -z "${PROFILE:-}" ] || delay='stragglers.delay_calls=3'
      compare "$table" --config="experiments/configs/digits.py:sync,workers=16,devices=8,eval_every=10,target_accuracy=0.95,stragglers.kind=lognormal,stragglers.sigma=0.02,stragglers.delayed_workers=2,$delay" \
        --seeds="$SEEDS" \
        --algorithms='sync;local_sgd,local_steps=4;local_sgd,local_steps=10;wagma;wagma,rule=step_then_average;wagma,fixed_groups=True;wagma,wait_avoiding=False' ;;
    wagma_constant|wagma_noise2|wagma_noise20)  # what staleness costs WAGMA: no delays, only compute noise
      case "$table" in
        wagma_constant) noise='stragglers.kind=constant' ;;
        wagma_noise2) noise='stragglers.kind=lognormal,stragglers.sigma=0.02' ;;
        *) noise='stragglers.kind=lognormal,stragglers.sigma=0.2' ;;
      esac
      compare "$table" --config="experiments/configs/digits.py:sync,workers=16,devices=8,eval_every=10,target_accuracy=0.95,$noise" \
        --seeds="$SEEDS" --algorithms='sync;wagma;wagma,rule=step_then_average' ;;
    # Section 5, slow and stale gradients: softmax regression, P = 8, X ~ Exp(1) s, 1,000 simulated seconds.
    # (the budget: 1,604 iterations of the baseline K = 4 on a profile)
    stale_tradeoff)
      compare "$table" --config=experiments/configs/digits_stale.py --seeds="$SEEDS" "$(budget 1000 1604)" --evals=80 \
        --max_steps=10000 --baseline='ksync,k=4' --target_loss=0.15 \
        --algorithms='async;kbatch_async,k=4;kasync,k=4;ksync,k=1;ksync,k=2;ksync,k=4;ksync,k=8;kbatch_sync,k=4;adasync,base=ksync,k0=1;adasync,base=ksync,k0=2' ;;
    # Section 6(a), Ringmaster ASGD: MNIST-1D, worker i's times x sqrt(i + 1), no momentum, swept step size.
    ringmaster)
      # shellcheck disable=SC2046
      compare "$table" --config=experiments/configs/mnist1d.py:async,stragglers=sqrt $(swept) \
        --algorithms='ringmaster,max_delay=4;ringmaster,max_delay=8;async;kasync,k=4;kbatch_sync,k=2;kbatch_sync,k=4' \
        --baseline=async "$(budget 4 1745)" --max_steps=2000 --evals=40 \
        --sweep=optimizer.learning_rate=0.05,0.15,0.4 --config.optimizer.momentum=0.0 \
        --config.target_accuracy=0.6 ;;
    # Section 6(b), DiLoCo and Streaming DiLoCo: homogeneous compute, a slow network, inner AdamW.
    diloco)
      # shellcheck disable=SC2046
      compare "$table" --config=experiments/configs/mnist1d.py:sync $(swept) \
        --algorithms='sync;local_sgd,local_steps=8;diloco,local_steps=8;diloco,local_steps=8,outer_learning_rate=0.3;streaming_diloco,local_steps=8,fragments=4,delay=2' \
        "$(budget 6 156)" --max_steps=600 --evals=30 --sweep=optimizer.learning_rate=0.003,0.01 \
        --config.optimizer.name=adamw --config.target_accuracy=0.8 \
        $(hand_set --config.network.kind=alpha_beta --config.network.latency_s=1e-3 --config.network.bandwidth_gbps=0.02) ;;
    *) echo "unknown table '$table'; one of: nonblocking_slow nonblocking_slow_net nonblocking_random" \
            "nonblocking_random_net nonblocking_slow_overhead nonblocking_random_overhead lap_sgd lap_sgd_overhead lap_sgd_overhead90 dasgd wagma wagma_constant wagma_noise2 wagma_noise20 stale_tradeoff" \
            "ringmaster diloco" >&2; exit 2 ;;
  esac
done
