"""Real training runs on measured time: sync, nonblocking, local SGD, D-PSGD and WAGMA through the harness on 2
real CPU processes, one slowed, against the simulator's prediction for the speeds they measured.

  python benchmarks/real_run.py                              # digits, 2 processes, process 1 +4 ms/micro-batch
  python benchmarks/real_run.py --repeats=1 --num_steps=300 --debug_slow_process=1:0.008 --out=/tmp/real_run.json

Each algorithm is one `bash launch/multiprocess_cpu.sh 2 --config=experiments/configs/digits.py:NAME,
stragglers.kind=measured,workers=2,devices=2,...` run (`experiments/harness/measured_time.py`: nothing simulated, the
run's clock is its measured training time, nonblocking's counts come from measured speeds), with the same
seed, data and model, and the TEST-ONLY `--debug_slow_process=I:S` (process I sleeps S seconds in every
micro-batch it computes). From each run's metrics.jsonl and summary.json the table gives:
  - real s/it: the median over the metrics rows after the first (whose window holds nonblocking's probe and the
    first executions) of measured seconds per iteration;
  - real time to target accuracy and to target loss: the measured seconds until the evaluation accuracy first
    reached `--target_accuracy`, and the evaluation loss first fell to `--target_loss` (evaluations every
    `--eval_every` steps, left out of the clock; interpolated between the two evaluations around the crossing,
    `experiments.comparison.statistics.crossing`, as `experiments.compare` does), and the step of each
    (interpolated too);
    the target loss defaults to the highest of the runs' lowest evaluation losses (every run reaches it);
  - nonblocking's micro-batches per worker (mean over the rows after the first);
  - simulated: `benchmarks.real_stragglers.simulate_iteration_seconds` (the simulator's mean seconds per
    iteration for these algorithms on 2 workers with constant per-micro-batch times s_d, ideal network), fed the
    s_d that the nonblocking run fitted (summary's `measured_seconds_per_microbatch`); for nonblocking, the rule
    that ran: the deadline trigger with the budget max_d n_d s_d of the counts n_d measured speeds gave (He &
    Dube's first-finisher trigger would give a device that has not finished one micro-batch none, which
    measured speeds never do; its prediction is printed above the table); its times to target are
    that prediction times the real run's steps at the targets (the same trajectory on the simulated clock). It leaves
    out the per-call cost c_d, the all-reduce and the harness's host work per block, which the real run pays.
Runs are sequential (one at a time), `--repeats` rounds of every algorithm interleaved, so that other users of
the machine slow all algorithms alike; the table gives the median over the rounds of each figure (and the
range of real s/it), the load average before and after with it.
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

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

from benchmarks import real_stragglers  # pylint: disable=g-import-not-at-top
from waitless.experiments.comparison import statistics  # pylint: disable=g-import-not-at-top

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = real_stragglers.ALGORITHMS  # sync, nonblocking, local_sgd, dpsgd, wagma

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
  flags.DEFINE_integer('repeats', 3, 'Runs per algorithm, interleaved (nonblocking first in each round).', **where)
  flags.DEFINE_integer('local_steps', 4, 'local_sgd: H (also what the prediction simulates).', **where)
  flags.DEFINE_integer('seed', 0, 'The seed of every run (model init, data order).', **where)
  flags.DEFINE_string('workdir', '', 'Keep the runs here (default: a temporary directory).', **where)
  flags.DEFINE_string('out', '', 'Write the results as JSON here.', **where)


def config_arg(name: str) -> str:
  extra = f',local_steps={FLAGS.local_steps}' if name == 'local_sgd' else ''
  return (f'experiments/configs/digits.py:{name}{extra},stragglers.kind=measured,workers=2,devices=2,'
          f'microbatches={FLAGS.microbatches},num_steps={FLAGS.num_steps},eval_every={FLAGS.eval_every},'
          f'log_every={FLAGS.eval_every},checkpoint_every={FLAGS.num_steps},'
          f'target_accuracy={FLAGS.target_accuracy},seed={FLAGS.seed}')


def run(name: str, workdir: str) -> dict:
  """One 2-process run of `name` in `workdir`; its figures (`figures`, before the target loss is known)."""
  command = ['bash', os.path.join(ROOT, 'launch', 'multiprocess_cpu.sh'), '2', f'--config={config_arg(name)}',
             f'--workdir={workdir}', f'--debug_slow_process={FLAGS.debug_slow_process}']
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f'{name} failed (status {done.returncode}):\n{done.stderr[-3000:]}')
  return figures(workdir, FLAGS.target_accuracy)


def figures(workdir: str, target_accuracy: float) -> dict:
  """A finished measured run's figures from its metrics.jsonl and summary.json (`rows`: its evaluation rows,
  for `at_target_loss` once the target loss is known)."""
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps = np.array([r['step'] for r in rows], np.float64)
  times = np.array([r['sim_time'] for r in rows], np.float64)
  per_iteration = np.diff(times) / np.diff(steps)  # rows after the first
  evals = [{k: r[k] for k in ('step', 'sim_time', 'eval_accuracy', 'eval_loss')} for r in rows
           if r.get('eval_accuracy') is not None]
  counts = np.array([r['microbatches_done'] for r in rows[1:]], np.float64)
  return {'seconds_per_iteration': float(np.median(per_iteration)),
          'time_to_target': statistics.crossing(evals, 'eval_accuracy', target_accuracy, True)[0],
          'step_at_target': statistics.crossing(evals, 'eval_accuracy', target_accuracy, True, x='step')[0],
          'lowest_eval_loss': min(r['eval_loss'] for r in evals), 'rows': evals,
          'counts': counts.mean(axis=0).tolist(),
          'final_eval_accuracy': summary['final_eval_accuracy'], 'measured_time': summary['measured_time'],
          'wall_time': summary['wall_time'], 'num_params': summary['num_params'],
          'speeds_s': summary['measured_seconds_per_microbatch'], 'overhead_s': summary['measured_overhead_s']}


def at_target_loss(figures_: dict, target_loss: float) -> dict:
  """`figures_` with the measured seconds and the step at which its evaluation loss first fell to `target_loss`
  (None if it never did)."""
  rows = figures_['rows']
  return {**figures_, 'time_to_target_loss': statistics.crossing(rows, 'eval_loss', target_loss, False)[0],
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
  a round counts as infinite; None when the median misses); `range`: min and max real s/it."""
  per_iteration = [r['seconds_per_iteration'] for r in runs]
  missable = ('time_to_target', 'step_at_target', 'time_to_target_loss', 'step_at_target_loss')
  return {'seconds_per_iteration': float(np.median(per_iteration)), 'range': (min(per_iteration), max(per_iteration)),
          **{key: _median_or_none([r[key] for r in runs]) for key in missable},
          'counts': np.median([r['counts'] for r in runs], axis=0).tolist(),
          'final_eval_accuracy': float(np.median([r['final_eval_accuracy'] for r in runs])),
          'speeds_s': np.median([r['speeds_s'] for r in runs], axis=0).tolist(),
          'overhead_s': np.median([r['overhead_s'] for r in runs], axis=0).tolist(),
          'num_params': runs[0]['num_params'], 'runs': len(runs)}


def measured_round_s(speeds_s, counts) -> float:
  """max_d n_d s_d: the compute time of a round in which device d runs its measured count n_d (the run's mean,
  rounded) at its fitted s_d; the budget at which the simulator's deadline trigger gives every device the
  count measured speeds gave it."""
  return float(np.max(np.rint(np.asarray(counts, np.float64)) * np.asarray(speeds_s, np.float64)))


def simulated_for(name: str, predicted: dict) -> Optional[float]:
  """The prediction for `name`'s row: for nonblocking, the rule that ran (the deadline trigger at the measured
  round), not He & Dube's first-finisher trigger, which cuts a device that has not finished one micro-batch."""
  return predicted.get('nonblocking_deadline' if name == 'nonblocking' else name)


def _to_target(seconds: Optional[float], step: Optional[float]) -> str:
  return 'not reached' if seconds is None else f'{seconds:.2f} ({step:.0f})'


def _simulated_to_target(simulated: Optional[float], step: Optional[float]) -> str:
  return '-' if simulated is None or step is None else f'{simulated * step:.2f}'


def report(results: dict, predicted: dict, load: tuple, target_loss: float) -> str:
  nb = results.get('nonblocking')
  lines = [f"digits MLP, 2 processes x 1 CPU device, m = {FLAGS.microbatches}, {FLAGS.num_steps} steps, "
           f"median of {FLAGS.repeats} interleaved round(s), "
           f"--debug_slow_process={FLAGS.debug_slow_process}, target accuracy {FLAGS.target_accuracy}, target "
           f"loss {target_loss:.4f}; load average {load[0]:.2f} before, {load[1]:.2f} after"]
  if nb is not None:
    overhead = ', '.join(f'{c * 1e3:.2f} ms' for c in nb['overhead_s'])
    lines.append(f"nonblocking fitted c + n s (median over rounds): c {overhead}, "
                 f"s {', '.join(f'{s * 1e3:.2f} ms' for s in nb['speeds_s'])}; micro-batches per worker "
                 f"{', '.join(f'{c:.2f}' for c in nb['counts'])}")
  if 'nonblocking' in predicted:
    lines.append(f"nonblocking's simulated row: the deadline trigger at the measured round max_d n_d s_d; the "
                 f"simulator's first-finisher trigger, which gives a device that finished none 0, predicts "
                 f"{predicted['nonblocking'] * 1e3:.2f} ms/it")
  lines += ['', '| algorithm | real ms/it (min-max) | simulated ms/it | real / simulated | real s to target acc '
            '(step) | simulated | real s to target loss (step) | simulated | final accuracy |',
            '|---|---|---|---|---|---|---|---|---|']
  for name, r in results.items():
    sim = simulated_for(name, predicted)
    sim_cells = ('-', '-') if sim is None else (f'{sim * 1e3:.2f}', f"{r['seconds_per_iteration'] / sim:.2f}")
    low, high = r['range']
    real = f"{r['seconds_per_iteration'] * 1e3:.2f} ({low * 1e3:.1f}-{high * 1e3:.1f})"
    lines.append(f"| {name} | {real} | {sim_cells[0]} | {sim_cells[1]} | "
                 f"{_to_target(r['time_to_target'], r['step_at_target'])} | "
                 f"{_simulated_to_target(sim, r['step_at_target'])} | "
                 f"{_to_target(r['time_to_target_loss'], r['step_at_target_loss'])} | "
                 f"{_simulated_to_target(sim, r['step_at_target_loss'])} | {r['final_eval_accuracy']:.3f} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  from waitless.experiments.harness import slowdown  # pylint: disable=g-import-not-at-top
  from waitless import config_errors as errors  # pylint: disable=g-import-not-at-top
  try:
    slowdown.parse_slow(FLAGS.debug_slow_process, 2)
    if FLAGS.target_loss is not None:
      errors.require_number(FLAGS.target_loss, 'target_loss', 'must be a finite number > 0', lambda v: v > 0)
    errors.require_number(FLAGS.target_accuracy, 'target_accuracy', 'must be a number in (0, 1]',
                          lambda v: 0 < v <= 1)
    errors.require_int(FLAGS.repeats, 'repeats', 1)
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  names = sorted(FLAGS.algorithms, key=lambda n: n != 'nonblocking')
  root = FLAGS.workdir or tempfile.mkdtemp(prefix='real_run_')
  before = os.getloadavg()[0]
  runs = {name: [] for name in names}
  for round_ in range(FLAGS.repeats):
    for name in names:
      runs[name].append(run(name, os.path.join(root, f'{name}_{round_}')))
      print(f'{name} round {round_}: {runs[name][-1]["seconds_per_iteration"] * 1e3:.2f} ms/it, time to target '
            f'{runs[name][-1]["time_to_target"]}', file=sys.stderr)
  load = (before, os.getloadavg()[0])
  target_loss = default_target_loss(runs) if FLAGS.target_loss is None else FLAGS.target_loss
  runs = {name: [at_target_loss(r, target_loss) for r in rounds] for name, rounds in runs.items()}
  results = {name: median_of(r) for name, r in runs.items()}
  predicted = {}
  if 'nonblocking' in results:
    nb = results['nonblocking']
    predicted = real_stragglers.simulate_iteration_seconds(  # constant compute: a one-row trace
        np.asarray(nb['speeds_s'])[None], FLAGS.microbatches, 4 * nb['num_params'], 400, FLAGS.local_steps,
        nonblocking_deadline_s=measured_round_s(nb['speeds_s'], nb['counts']))
  print(report(results, predicted, load, target_loss))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({'results': results, 'runs': runs, 'simulated_s': predicted, 'load': load, 'workdir': root,
                 'target_loss': target_loss}, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
