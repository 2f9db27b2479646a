"""Real training runs on measured time: sync, nonblocking, local SGD, D-PSGD, WAGMA and DiLoCo through the harness
on 2 real CPU processes, one slowed, against the simulator's prediction on the cluster profile `calibrate` measured.

  python -m waitless.experiments.calibrate --config=experiments/configs/digits.py:sync,microbatches=4 \
      --processes=2 --out=/tmp/this_machine.json                 # the profile (a few minutes)
  python benchmarks/real_run.py --profile=/tmp/this_machine.json  # digits, 2 processes, process 1 +4 ms/micro-batch
  python benchmarks/real_run.py --profile=/tmp/this_machine.json --seeds=0 --num_steps=300 \
      --debug_slow_process=1:0.008 --out=/tmp/real_run.json

Each algorithm is one `bash launch/multiprocess_cpu.sh 2 --config=experiments/configs/digits.py:NAME,
stragglers.kind=measured,workers=2,devices=2,...` run (`experiments/harness/measured_time.py`: nothing simulated, the
run's clock is its measured training time, nonblocking's counts come from measured speeds), with the same
seed, data and model, and the TEST-ONLY `--debug_slow_process=I:S` (process I sleeps S seconds in every
micro-batch it computes). From each run's metrics.jsonl and summary.json the table gives:
  - real s/it: the median over the metrics rows after the warm-up (the first row, whose window holds the first
    executions; nonblocking's first two, `WARMUP_ROWS`) of measured seconds per iteration, robust to another
    user's burst of load; and the mean, measured seconds over the iterations after the warm-up, which a time to
    target adds up (the simulator's mean iteration time predicts both where the load is steady);
  - real time to target accuracy and to target loss: the measured seconds from the end of the warm-up (first
    executions, nonblocking's probes and its second program, which no simulator models) until the evaluation
    accuracy first reached `--target_accuracy`, and the evaluation loss first fell to `--target_loss` (evaluations every
    `--eval_every` steps, left out of the clock; interpolated between the two evaluations around the crossing,
    `experiments.comparison.statistics.crossing`, as `experiments.compare` does), and the step of each
    (interpolated too);
    the target loss defaults to the highest of the runs' lowest evaluation losses (every run reaches it);
  - nonblocking's micro-batches per worker (mean over the rows after the first);
  - predicted (`--profile`, the profile calibrate wrote for this machine): `experiments.simulate` of
    the same config (2 workers, m micro-batches, the algorithm's own time rule) with `cluster.profile` set, so
    the clock charges the profile's per-sample and per-call compute, its all-reduce and point-to-point costs and
    its host time per iteration; the TEST-ONLY slowdown, S seconds in every micro-batch of process I, is
    `stragglers.worker_factors` with worker I's factor (t + S) / t, t = overhead_s + (B / m) per_sample_s the
    profile's micro-batch. Nothing is fitted to the real runs. Beside it, a diagnostic that is: the prediction
    with the slowed worker's micro-batch as the runs measured it (`measured_slow_microbatch_s`: the sleep, its
    host callback and the compute of a device that sleeps, which no profile figure holds), so that the error
    the slowdown's own cost makes is told from the profile's. For the two rules that no lock-step program
    runs, the table predicts what the real program runs and names the rule's own figure a simulated ideal:
    nonblocking with measured speeds runs the deadline trigger at the budget max_d n_d t_d of the counts
    n_d that `measured_speeds.microbatch_counts` gives the profile's speeds (the ideal: He & Dube's
    first-finisher trigger); WAGMA runs lock-step groups that wait for every member, with no overlap on a CPU
    (`wait_avoiding=False, rule='step_then_average'`; the ideal: the wait-avoiding rule). Predicted times to
    target are the predicted seconds per iteration times the real run's steps at the target;
  - in --out only (`ideal_network_s`), an earlier prediction: `benchmarks.real_stragglers.simulate_iteration_seconds`
    on an ideal network with the s_d that the nonblocking run fitted (no per-call cost, collectives or host time).
Every seed of `--seeds` is one round of every algorithm (`--repeats` rounds per seed), run one at a time and
interleaved, so that other users of the machine slow all algorithms alike; the table gives the median over
the rounds of each figure and the range of real s/it; "ranking" compares every pair of algorithms whose real
times per iteration differ by more than their ranges (the noise; 2 runs or more of each) with the predicted
order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import numpy as np

from benchmarks import real_stragglers
from waitless.experiments.comparison import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = real_stragglers.ALGORITHMS + ('diloco',)  # sync, nonblocking, local_sgd, dpsgd, wagma, diloco
PERIODIC = ('local_sgd', 'diloco')  # one all-reduce per --local_steps

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags, in `flag_values`; defined when the script runs, not on import (a test process that also imports
  another benchmark would define `repeats`, `microbatches`, ... twice), as `real_stragglers.define_flags`."""
  where = {'flag_values': flag_values}
  flags.DEFINE_list('algorithms', list(ALGORITHMS), 'Algorithms to run (nonblocking first: its speeds feed the '
                    'prediction).', **where)
  flags.DEFINE_string('debug_slow_process', '1:0.004', 'TEST-ONLY: "I:S", process I sleeps S seconds per '
                      'micro-batch it computes.', **where)
  flags.DEFINE_integer('microbatches', 4, 'm, micro-batches per worker and iteration (batch 16 per worker).',
                       **where)
  flags.DEFINE_integer('num_steps', 200, 'Iterations per run.', **where)
  flags.DEFINE_integer('eval_every', 10, 'Steps between evaluations (and metrics rows).', **where)
  flags.DEFINE_float('target_accuracy', 0.96, 'Evaluation accuracy of the time to target accuracy.', **where)
  flags.DEFINE_float('target_loss', None, 'Evaluation loss of the time to target loss (default: the highest of the '
                     "runs' lowest evaluation losses, a level every run reaches).", **where)
  flags.DEFINE_integer('repeats', 1, 'Rounds per seed, interleaved (nonblocking first in each round).', **where)
  flags.DEFINE_integer('local_steps', 4, 'local_sgd and diloco: H (also what the prediction simulates).', **where)
  flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (model init, data order); one round of every algorithm each.',
                    **where)
  flags.DEFINE_string('profile', None, 'Required: the cluster profile of the prediction, the path that '
                      'experiments.calibrate wrote for this machine (or a shipped name).', **where)
  flags.DEFINE_string('workdir', '', 'Keep the runs here (default: a temporary directory); runs finished there '
                      'before are read, not run again.', **where)
  flags.DEFINE_string('out', '', 'Write the results as JSON here.', **where)


def pairs(name: str, seed: int) -> str:
  """The config argument's algorithm and pairs shared by the real run and its prediction."""
  extra = f',local_steps={FLAGS.local_steps}' if name in PERIODIC else ''
  return (f'{name}{extra},workers=2,devices=2,microbatches={FLAGS.microbatches},num_steps={FLAGS.num_steps},'
          f'eval_every={FLAGS.eval_every},log_every={FLAGS.eval_every},checkpoint_every={FLAGS.num_steps},'
          f'target_accuracy={FLAGS.target_accuracy},seed={seed}')


def config_arg(name: str, seed: int) -> str:
  return f'experiments/configs/digits.py:{pairs(name, seed)},stragglers.kind=measured'


def run(name: str, seed: int, workdir: str) -> dict:
  """One 2-process run of `name` in `workdir`; its figures (`figures`, before the target loss is known). A run
  that finished there before (`--workdir` of an earlier call) is read, not run again."""
  warmup = WARMUP_ROWS.get(name, 1)
  if os.path.isfile(os.path.join(workdir, 'summary.json')):
    return figures(workdir, FLAGS.target_accuracy, warmup)
  command = ['bash', os.path.join(ROOT, 'launch', 'multiprocess_cpu.sh'), '2', f'--config={config_arg(name, seed)}',
             f'--workdir={workdir}', f'--debug_slow_process={FLAGS.debug_slow_process}']
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f'{name} failed (status {done.returncode}):\n{done.stderr[-3000:]}')
  return figures(workdir, FLAGS.target_accuracy, warmup)


# Metrics rows of warm-up per algorithm (1 otherwise): the first row holds the first executions (and a
# process's compile that the other waits for at the first collective). Non-blocking SGD's probes run blocks
# of one iteration, so its first block of the usual length runs a second program, in its second row: the
# other process's compile of it delays the first collective (36-110 ms per iteration in that row against
# 20 after it, every seed), a warm-up that no simulator models.
WARMUP_ROWS = {'nonblocking': 2}


def figures(workdir: str, target_accuracy: float, warmup_rows: int = 1) -> dict:
  """A finished measured run's figures from its metrics.jsonl and summary.json (`rows`: its evaluation rows,
  for `at_target_loss` once the target loss is known); per iteration and counts from the rows after the first
  `warmup_rows`, times to target counted from the end of the last of them (`first_step`, `first_time`)."""
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps = np.array([r['step'] for r in rows], np.float64)
  times = np.array([r['measured_time'] for r in rows], np.float64)
  w = warmup_rows - 1  # the last warm-up row
  per_iteration = np.diff(times[w:]) / np.diff(steps[w:])  # rows after the warm-up
  evals = [{k: r[k] for k in ('step', 'measured_time', 'eval_accuracy', 'eval_loss')} for r in rows
           if r.get('eval_accuracy') is not None]
  counts = np.array([r['microbatches_done'] for r in rows[w + 1:]], np.float64)
  return {'seconds_per_iteration': float(np.median(per_iteration)),
          'mean_seconds_per_iteration': float((times[-1] - times[w]) / (steps[-1] - steps[w])),
          'time_to_target': statistics.crossing(evals, 'eval_accuracy', target_accuracy, True, x='measured_time')[0],
          'step_at_target': statistics.crossing(evals, 'eval_accuracy', target_accuracy, True, x='step')[0],
          'lowest_eval_loss': min(r['eval_loss'] for r in evals), 'rows': evals,
          'first_step': float(steps[w]), 'first_time': float(times[w]),  # the end of the warm-up
          'counts': counts.mean(axis=0).tolist(),
          'final_eval_accuracy': summary['final_eval_accuracy'], 'measured_time': summary['measured_time'],
          'wall_time': summary['wall_time'], 'num_params': summary['num_params'],
          'speeds_s': summary['measured_seconds_per_microbatch'], 'overhead_s': summary['measured_overhead_s']}


def at_target_loss(figures_: dict, target_loss: float) -> dict:
  """`figures_` with the measured seconds and the step at which its evaluation loss first fell to `target_loss`
  (None if it never did)."""
  rows = figures_['rows']
  return {**figures_,
          'time_to_target_loss': statistics.crossing(rows, 'eval_loss', target_loss, False, x='measured_time')[0],
          'step_at_target_loss': statistics.crossing(rows, 'eval_loss', target_loss, False, x='step')[0]}


def default_target_loss(runs: dict) -> float:
  """The highest of every run's lowest evaluation loss: a loss level that every run reached."""
  return max(r['lowest_eval_loss'] for rounds in runs.values() for r in rounds)


def _median_or_none(values: list) -> Optional[float]:
  """The median, a None (a target missed) counting as infinite; None when the median is a miss."""
  median = float(np.median([np.inf if v is None else v for v in values]))
  return median if np.isfinite(median) else None


def median_of(runs: list[dict]) -> dict:
  """The median over the rounds of each figure of one algorithm's runs (a time to target or its step missed in
  a round counts as infinite; None when the median misses); `range`: min and max real s/it. Times to target
  are each run's seconds after its warm-up (`first_time` of the result: 0)."""
  per_iteration = [r['seconds_per_iteration'] for r in runs]
  after = lambda r, key: None if r[key] is None else r[key] - r.get('first_time', 0.0)
  steps = ('step_at_target', 'step_at_target_loss')
  return {'seconds_per_iteration': float(np.median(per_iteration)), 'range': (min(per_iteration), max(per_iteration)),
          'mean_seconds_per_iteration': float(np.median([r.get('mean_seconds_per_iteration', r['seconds_per_iteration'])
                                                         for r in runs])),
          **{key: _median_or_none([after(r, key) for r in runs]) for key in ('time_to_target', 'time_to_target_loss')},
          **{key: _median_or_none([r[key] for r in runs]) for key in steps},
          'counts': np.median([r['counts'] for r in runs], axis=0).tolist(),
          'final_eval_accuracy': float(np.median([r['final_eval_accuracy'] for r in runs])),
          'speeds_s': np.median([r['speeds_s'] for r in runs], axis=0).tolist(),
          'overhead_s': np.median([r['overhead_s'] for r in runs], axis=0).tolist(),
          'num_params': runs[0]['num_params'], 'runs': len(runs),
          'first_step': runs[0].get('first_step', 0.0),
          'first_time': 0.0}


def measured_round_s(speeds_s, counts) -> float:
  """max_d n_d s_d: the compute time of a round in which device d runs its measured count n_d (the run's mean,
  rounded) at its fitted s_d; the budget at which the simulator's deadline trigger gives every device the
  count measured speeds gave it."""
  return float(np.max(np.rint(np.asarray(counts, np.float64)) * np.asarray(speeds_s, np.float64)))


def _to_target(seconds: Optional[float], step: Optional[float], first_time: float = 0.0) -> str:
  return 'not reached' if seconds is None else f'{seconds - first_time:.2f} ({step:.0f})'


def _simulated_to_target(simulated: Optional[float], step: Optional[float], first_step: float = 0.0) -> str:
  return '-' if simulated is None or step is None else f'{simulated * (step - first_step):.2f}'


IDEALS = {'nonblocking': 'nonblocking, simulated ideal: first-finisher trigger',
          'wagma': 'wagma, simulated ideal: wait-avoiding groups'}


def measured_slow_microbatch_s(runs: dict, process: int) -> Optional[float]:
  """The slowed worker's seconds per micro-batch as the runs measured it: the median over the runs in which every
  device ran all m micro-batches (all but nonblocking's) of its fitted c / m + s; None with no slowed worker."""
  if process < 0:
    return None
  per_run = [r['overhead_s'][process] / FLAGS.microbatches + r['speeds_s'][process]
             for name, rounds in runs.items() if name != 'nonblocking' for r in rounds if r['speeds_s']]
  return float(np.median(per_run)) if per_run else None


def predict_on_profile(names, slow: tuple[int, float], iterations: int = 400,
                       slow_microbatch_s: Optional[float] = None) -> dict:
  """name -> predicted seconds per iteration on `--profile` (what the real program runs), and IDEALS[name] ->
  the rule's own simulated ideal where no lock-step program runs it; `_micro-batch_s`: the profile's t_d;
  `slow`: (process, seconds it adds to each of its micro-batches), -1 for none; `slow_microbatch_s`: instead,
  the slowed worker's whole micro-batch (`measured_slow_microbatch_s`, a diagnostic)."""
  from waitless.cluster import factory
  from waitless.experiments.harness import measured_speeds
  from waitless.experiments import simulate
  from waitless.experiments.configs import digits
  out = {}
  for name in names:
    config = digits.get_config(pairs(name, 0))
    config.cluster.profile = FLAGS.profile
    cost = factory.effective(config).stragglers
    t = cost.overhead_s + cost.base_s  # the profile's micro-batch call
    factors = np.ones(config.workers)
    if slow[0] >= 0:
      factors[slow[0]] = (t + slow[1]) / t if slow_microbatch_s is None else slow_microbatch_s / t
    config.stragglers.worker_factors = tuple(float(f) for f in factors)
    nbytes = simulate.model_bytes(config)

    def seconds(config_, **algorithm):
      config_ = config_.copy_and_resolve_references()
      for key, value in algorithm.items():
        config_.algorithm[key] = value
      return simulate.simulate(config_, iterations=iterations, nbytes=nbytes)['mean_iteration_time']

    if name == 'nonblocking':  # measured speeds' counts (MeasuredStep's tolerance) and the round they need
      speeds = t * factors
      counts = measured_speeds.microbatch_counts(speeds, FLAGS.microbatches, tolerance=0.1, min_slack_s=0.001)
      out[name] = seconds(config, trigger='deadline', deadline_s=float(np.max(counts * speeds)))
      out['_counts'] = counts.tolist()
    elif name == 'wagma':
      out[name] = seconds(config, wait_avoiding=False, rule='step_then_average')
    else:
      out[name] = seconds(config)
    if name in IDEALS:
      out[IDEALS[name]] = seconds(config)
    out['_microbatch_s'] = (t * factors).tolist()
  return out


def ranking(results: dict, predicted: dict) -> list[str]:
  """The pairs whose real times per iteration differ by more than the noise (their ranges over the runs do not
  overlap), each with whether the prediction orders them the same way; with fewer than 2 runs of an algorithm
  there is no noise to compare with, and its pairs are not judged."""
  lines, names = [], [name for name in results if results[name]['runs'] >= 2]
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      (low_a, high_a), (low_b, high_b) = results[a]['range'], results[b]['range']
      if high_a < low_b or high_b < low_a:
        faster, slower = (a, b) if high_a < low_b else (b, a)
        same = predicted[faster] < predicted[slower]
        lines.append(f'{faster} < {slower}: {"same order" if same else "REVERSED by the prediction"}')
  return lines


def _error(predicted: Optional[float], real: Optional[float]) -> str:
  return '-' if predicted is None or real is None else f'{100 * (predicted - real) / real:+.0f}%'


def report(results: dict, predicted: dict, measured: dict, load: tuple, target_loss: float) -> str:
  """The table: `predicted` on the profile, `measured` the diagnostic with the slowed worker's measured
  micro-batch (`_slow_microbatch_s`; {} for none)."""
  nb = results.get('nonblocking')
  ms = lambda values: ', '.join(f'{v * 1e3:.2f}' for v in values)
  lines = [f"digits MLP, 2 processes x 1 CPU device, m = {FLAGS.microbatches}, {FLAGS.num_steps} steps, seeds "
           f"{','.join(FLAGS.seeds)} x {FLAGS.repeats} round(s), --debug_slow_process={FLAGS.debug_slow_process}, "
           f"target accuracy {FLAGS.target_accuracy}, target loss {target_loss:.4f}; profile {FLAGS.profile}; "
           f"load average {load[0]:.2f} before, {load[1]:.2f} after",
           f"profile's micro-batch per worker (ms): {ms(predicted['_microbatch_s'])}; the slowed worker's as the runs "
           f"measured it {measured.get('_slow_microbatch_s', float('nan')) * 1e3:.2f} ms (the diagnostic column)"]
  if nb is not None:
    lines.append(f"nonblocking: real counts per worker {', '.join(f'{c:.2f}' for c in nb['counts'])}, predicted "
                 f"{predicted.get('_counts')}; its fitted c (ms) {ms(nb['overhead_s'])}, s (ms) {ms(nb['speeds_s'])}")
  lines += ['', 'Times to target from the end of the warm-up rows (first executions; nonblocking\'s probes and its '
            'second program: 2 rows), predicted as ms/it x the real steps after them.', '',
            '| algorithm | real ms/it: median of rows (range) | real mean | predicted on the profile | error | '
            'diagnostic: slowed worker as measured | real s to target acc (step) | predicted | '
            'real s to target loss (step) | predicted | error | final accuracy |',
            '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for name, r in results.items():
    sim, before = predicted[name], measured.get(name)
    low, high = r['range']
    first_step, first_time = r['first_step'], r['first_time']  # times to target from the end of the warm-up row
    loss_step, loss_time = r['step_at_target_loss'], r['time_to_target_loss']
    loss_sim = None if loss_step is None else sim * (loss_step - first_step)
    lines.append(
        f"| {name} | {r['seconds_per_iteration'] * 1e3:.2f} ({low * 1e3:.1f}-{high * 1e3:.1f}) | "
        f"{r['mean_seconds_per_iteration'] * 1e3:.2f} | {sim * 1e3:.2f} | "
        f"{_error(sim, r['seconds_per_iteration'])} | {'-' if before is None else f'{before * 1e3:.2f}'} | "
        f"{_to_target(r['time_to_target'], r['step_at_target'], first_time)} | "
        f"{_simulated_to_target(sim, r['step_at_target'], first_step)} | "
        f"{_to_target(loss_time, loss_step, first_time)} | {_simulated_to_target(sim, loss_step, first_step)} | "
        f"{_error(loss_sim, None if loss_time is None else loss_time - first_time)} | "
        f"{r['final_eval_accuracy']:.3f} |")
    if name in IDEALS:
      lines.append(f"| {IDEALS[name]} | (no lock-step program) | | {predicted[IDEALS[name]] * 1e3:.2f} | | | | | | | "
                   "| |")
  lines += ['', 'ranking where the real gap exceeds the noise: ' + ('; '.join(ranking(results, predicted)) or 'none')]
  return '\n'.join(lines)


def main(argv):
  del argv
  from waitless.experiments.harness import slowdown
  from waitless import config_errors as errors
  try:
    errors.require(bool(FLAGS.profile), 'profile', FLAGS.profile,
                   'required: the profile experiments.calibrate wrote for this machine')
    slow = slowdown.parse_slow(FLAGS.debug_slow_process, 2)
    if FLAGS.target_loss is not None:
      errors.require_number(FLAGS.target_loss, 'target_loss', 'must be a finite number > 0', lambda v: v > 0)
    errors.require_number(FLAGS.target_accuracy, 'target_accuracy', 'must be a number in (0, 1]',
                          lambda v: 0 < v <= 1)
    errors.require_int(FLAGS.repeats, 'repeats', 1)
    errors.require(all(s.isdigit() for s in FLAGS.seeds) and bool(FLAGS.seeds), 'seeds', FLAGS.seeds,
                   'must be a list of integers >= 0')
    names = sorted(FLAGS.algorithms, key=lambda n: n != 'nonblocking')
    predicted = predict_on_profile(names, slow)  # before anything runs: a bad profile fails here
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  root = FLAGS.workdir or tempfile.mkdtemp(prefix='real_run_')
  before = os.getloadavg()[0]
  runs = {name: [] for name in names}
  for seed in FLAGS.seeds:
    for round_ in range(FLAGS.repeats):
      for name in names:
        runs[name].append(run(name, int(seed), os.path.join(root, f'{name}_seed{seed}_{round_}')))
        print(f'{name} seed {seed} round {round_}: {runs[name][-1]["seconds_per_iteration"] * 1e3:.2f} ms/it, '
              f'time to target {runs[name][-1]["time_to_target"]}', file=sys.stderr)
  load = (before, os.getloadavg()[0])
  slow_s = measured_slow_microbatch_s(runs, slow[0])
  measured = {} if slow_s is None else {**predict_on_profile(names, slow, slow_microbatch_s=slow_s),
                                        '_slow_microbatch_s': slow_s}
  target_loss = default_target_loss(runs) if FLAGS.target_loss is None else FLAGS.target_loss
  runs = {name: [at_target_loss(r, target_loss) for r in rounds] for name, rounds in runs.items()}
  results = {name: median_of(r) for name, r in runs.items()}
  ideal = {}
  if 'nonblocking' in results:
    nb = results['nonblocking']
    ideal = real_stragglers.simulate_iteration_seconds(  # constant compute: a one-row trace
        np.asarray(nb['speeds_s'])[None], FLAGS.microbatches, 4 * nb['num_params'], 400, FLAGS.local_steps,
        nonblocking_deadline_s=measured_round_s(nb['speeds_s'], nb['counts']))
  print(report(results, predicted, measured, load, target_loss))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({'results': results, 'runs': runs, 'predicted_s': predicted, 'measured_slow_predicted_s': measured,
                 'ideal_network_s': ideal,
                 'load': load, 'workdir': root, 'target_loss': target_loss, 'profile': FLAGS.profile}, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
