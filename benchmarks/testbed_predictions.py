"""Predictions against real runs on the shaped test bed: every algorithm's time per iteration and time to target, the
median of repeated real runs beside `simulate` on the bed's calibrated profile, nothing fitted to the runs.

  # 1. the bed's profile (calibrate on the bed: its processes in the hosts' cgroups, the shaped link measured)
  python -m waitless.experiments.testbed --cpus=0.8,0.8 --rate_mbit=174 -- calibrate \
      --config=experiments/configs/digits.py:sync,batch_size=512,microbatches=4 \
      --config.model.hidden_sizes='(512,512)' --processes=2 --rounds=3 --harness_steps=60 --out=bed174.json
  # 2. the runs (root: it builds a bed per run) and the table
  python benchmarks/testbed_predictions.py --profile=bed174.json --rate_mbit=174 --hosts=2 \
      --algorithms=sync,local_sgd,dpsgd --runs=8 --out=/tmp/tb174.json

The grid of the issue is this command at two rates (each with its own profile: communication-bound, 174 Mbit/s, and
compute-bound, 868), at --hosts=2 and 4, over every algorithm that runs for real: the SPMD ones and the
parameter-server family (`ray:NAME`, e.g. `ray:kasync`: Ray's head, the driver and the server on host 0, a learner
on each other host, `workers` = hosts - 1).

Per cell (an algorithm under a condition: `equal`, every host `--cpu` cores; `slow`, the last host `--slow_cpu`):
  real        each run one `experiments.testbed -- spmd` (or `-- ray`) run of the workload on measured time
              (`stragglers.kind=measured`), a bed of its own; its figure its measured seconds per iteration over
              its metrics rows after the first (the first executions): their time over their steps, the mean rate
              `simulate` predicts (not the median row: rows of a periodic algorithm differ), and its time to
              `--target_accuracy` from the end of that row (interpolated between evaluations, as `compare` does).
              The cell's figure is the median of `--runs` runs, run interleaved (round r runs every cell once), with
              their range.
  predicted   `experiments.simulate` of the same config on `--profile` (its compute, per-call overhead, host time,
              all-reduce and point-to-point figures); the slow host is `stragglers.worker_factors` (with
              `cluster.slow_hosts`: its host work slows too), its factor the ratio of the per-sample compute
              `calibrate` measured on hosts of the two quotas (the profile's `per_cpu`, `profiles.quota_factors`;
              `calibrate --host_compute_only` on a bed with the slow quota adds it), else the ratio of the quotas
              (`--cpu` / `--slow_cpu`); either way the bed's measurement or spec, not a run's. Time to target:
              predicted s/it x the real run's steps to the target (after the warm-up row).
  error       (predicted - real) / real; the targets: every cell within 10%, the mean |error| within 3%.
  ranking     per condition, every pair of algorithms whose real ranges do not overlap, and whether the
              prediction orders them the same way.
Needs root (the bed); `--workdir` keeps the runs (a finished run there is read, not run again).
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

from waitless.experiments.comparison import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERIODIC = ('local_sgd', 'diloco')
CONDITIONS = ('equal', 'slow')

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags, in `flag_values`; defined when the script runs, not on import (as `real_run.define_flags`: a
  test process that imports several benchmarks would define `algorithms`, `runs`, ... twice)."""
  where = {'flag_values': flag_values}
  flags.DEFINE_string('profile', None, 'The bed\'s profile (calibrate run on the bed at --rate_mbit).', **where)
  flags.DEFINE_float('rate_mbit', 174.0, 'Every host link\'s rate per direction, Mbit/s.', **where)
  flags.DEFINE_integer('hosts', 2, 'Hosts of the bed (2-4).', **where)
  flags.DEFINE_float('cpu', 0.8, 'Cores of every host (cgroup quota).', **where)
  flags.DEFINE_integer('cpu_weight', 8192, 'The hosts\' cpu.shares (experiments.testbed --cpu_weight; 1024 is a '
                       'plain process\'s): 8192 halved the range of a cell\'s runs under other work (issue 56), at '
                       'that work\'s expense.', **where)
  flags.DEFINE_float('slow_cpu', 0.4, 'Cores of the slow host (the last) under the `slow` condition.', **where)
  flags.DEFINE_list('conditions', list(CONDITIONS), 'equal, slow.', **where)
  flags.DEFINE_list('algorithms', ['sync', 'local_sgd', 'dpsgd'], 'SPMD names, or ray:NAME for the '
                    'parameter-server family on Ray; +FIELD=VALUE adds an algorithm field (ray:kasync+k=1).', **where)
  flags.DEFINE_integer('runs', 8, 'Real runs per cell (interleaved rounds).', **where)
  flags.DEFINE_integer('num_steps', 100, 'Iterations per run.', **where)
  flags.DEFINE_integer('eval_every', 10, 'Steps between evaluations (and metrics rows).', **where)
  flags.DEFINE_integer('microbatches', 1, 'm, micro-batches per worker and iteration.', **where)
  flags.DEFINE_integer('local_steps', 4, 'local_sgd, diloco: H.', **where)
  flags.DEFINE_float('target_accuracy', 0.9, 'Evaluation accuracy of the time to target.', **where)
  flags.DEFINE_string('workload', 'experiments/configs/digits.py', 'The config file.', **where)
  flags.DEFINE_string('pairs', 'batch_size=512', 'Config pairs of the workload (after the algorithm).', **where)
  flags.DEFINE_list('overrides', ['model.hidden_sizes=(512,512)'], 'FIELD=VALUE config overrides.', **where)
  flags.DEFINE_string('model_key', '', 'The workload\'s compute entry in the profile (default: its only one).',
                      **where)
  flags.DEFINE_string('workdir', '', 'Keep the runs here (default: a temporary directory).', **where)
  flags.DEFINE_string('out', '', 'Write the results as JSON here.', **where)
  flags.DEFINE_string('figure', '', 'Draw predicted against real (every cell, its range) as a PNG here.', **where)
  flags.DEFINE_float('timeout_s', 600, 'A run that takes longer is stopped (the benchmark fails).', **where)


def cpus(condition: str) -> list[float]:
  quotas = [FLAGS.cpu] * FLAGS.hosts
  if condition == 'slow':
    quotas[-1] = FLAGS.slow_cpu
  return quotas


def split(algorithm: str) -> tuple[str, bool]:
  """(the config argument's algorithm and its pairs, on Ray): `ray:kasync+k=1` -> ('kasync,k=1', True)."""
  name = algorithm.replace('+', ',')
  return (name[4:], True) if name.startswith('ray:') else (name, False)


def workers(algorithm: str) -> int:
  return FLAGS.hosts - 1 if split(algorithm)[1] else FLAGS.hosts


def pairs(algorithm: str, seed: int) -> str:
  """The config argument's pairs, shared by the real run and its prediction."""
  name, ray = split(algorithm)
  extra = f',local_steps={FLAGS.local_steps}' if name.split(',')[0] in PERIODIC else ''
  p = workers(algorithm)
  placement = f',runtime=ray,workers={p}' if ray else f',workers={p},devices={p}'
  return (f'{name}{extra}{placement},{FLAGS.pairs},microbatches={FLAGS.microbatches},num_steps={FLAGS.num_steps},'
          f'eval_every={FLAGS.eval_every},log_every={FLAGS.eval_every},checkpoint_every={FLAGS.num_steps},'
          f'target_accuracy={FLAGS.target_accuracy},seed={seed}')


def run(algorithm: str, condition: str, seed: int, workdir: str) -> dict:
  """One real run on a bed of its own; its figures. A run finished in `workdir` before is read."""
  if not os.path.isfile(os.path.join(workdir, 'summary.json')):
    name, ray = split(algorithm)
    measured = '' if ray else ',stragglers.kind=measured'  # a Ray run's time is always measured
    config = f'--config={FLAGS.workload}:{pairs(algorithm, seed)}{measured}'
    command = [sys.executable, '-m', 'waitless.experiments.testbed', f'--cpus={",".join(map(str, cpus(condition)))}',
               f'--rate_mbit={FLAGS.rate_mbit}', f'--timeout_s={FLAGS.timeout_s}',
               *([f'--cpu_weight={FLAGS.cpu_weight}'] if FLAGS.cpu_weight else []), '--', 'ray' if ray else 'spmd',
               config, *[f'--config.{o}' for o in FLAGS.overrides], f'--workdir={workdir}']
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
      raise SystemExit(f'{algorithm} ({condition}) failed (status {done.returncode}):\n{done.stdout[-1500:]}'
                       f'{done.stderr[-1500:]}')
  return figures(workdir)


def figures(workdir: str) -> dict:
  """A finished run's seconds per iteration over its rows after the first (their time over their steps: the mean
  rate `simulate` predicts), its median row (a diagnostic: where rows are unalike, e.g. local SGD's averaging every
  4 steps in rows of 10, the median row is one kind of row, not the run's rate), and its time to the target
  accuracy from the end of the first row (None if never reached)."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps = np.array([r['step'] for r in rows], np.float64)
  times = np.array([r['measured_time'] for r in rows], np.float64)
  evals = [{k: r[k] for k in ('step', 'measured_time', 'eval_accuracy')} for r in rows
           if r.get('eval_accuracy') is not None]
  at, step = (statistics.crossing(evals, 'eval_accuracy', FLAGS.target_accuracy, True, x=x)[0]
              for x in ('measured_time', 'step'))
  return {'seconds_per_iteration': float((times[-1] - times[0]) / (steps[-1] - steps[0])),
          'median_row_s': float(np.median(np.diff(times) / np.diff(steps))),
          'time_to_target': None if at is None else float(at - times[0]),
          'steps_to_target': None if step is None else float(step - steps[0])}


def worker_factors(quotas: list[float], model: str) -> tuple[tuple[float, ...], str]:
  """(each worker's compute factor on hosts of `quotas` cores, where it comes from): the per-sample compute the
  profile measured at those quotas (`profiles.quota_factors`), else the quotas' ratio."""
  from waitless.cluster import profiles
  measured = profiles.quota_factors(profiles.load(FLAGS.profile).compute_for(model), quotas)
  if measured is not None:
    return measured, 'per_cpu'
  return tuple(max(quotas) / q for q in quotas), 'quota ratio'


def model_key() -> str:
  """The workload's compute key in the profile ('dataset/model'): `--model_key`, or the profile's only one."""
  from waitless import config_errors as errors
  from waitless.cluster import profiles
  if FLAGS.model_key:
    return FLAGS.model_key
  models = sorted(profiles.load(FLAGS.profile).compute)
  errors.require(len(models) == 1, '--model_key', FLAGS.model_key,
                 f'required: the profile holds several models ({", ".join(models)})')
  return models[0]


def predict(algorithm: str, condition: str, iterations: int = 400) -> float:
  """`python -m waitless.experiments.simulate` of the cell's config on `--profile` (the command a user runs), the
  slow host a worker factor (`worker_factors`) of its compute and host work; its mean seconds per iteration."""
  quotas = cpus(condition)
  if split(algorithm)[1]:  # the learners live on hosts 1.., the server on host 0
    quotas = quotas[1:]
  factors = ','.join(f'{f:.4g}' for f in worker_factors(quotas, model_key())[0])
  command = [sys.executable, '-m', 'waitless.experiments.simulate', f'--config={FLAGS.workload}:{pairs(algorithm, 0)}',
             *[f'--config.{o}' for o in FLAGS.overrides], f'--config.cluster.profile={FLAGS.profile}',
             f'--config.stragglers.worker_factors=({factors},)', '--config.cluster.slow_hosts=True',
             f'--iterations={iterations}']
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f'simulate of {algorithm} ({condition}) failed (status {done.returncode}): {done.stderr[-1500:]}')
  return float(json.loads(done.stdout)['mean_iteration_time'])


def _error(predicted: Optional[float], real: Optional[float]) -> Optional[float]:
  return None if predicted is None or real is None else (predicted - real) / real


def summarize(runs: list[dict], predicted_s: float) -> dict:
  per_iteration = [r['seconds_per_iteration'] for r in runs]
  to_target = [np.inf if r['time_to_target'] is None else r['time_to_target'] for r in runs]
  steps = [np.inf if r['steps_to_target'] is None else r['steps_to_target'] for r in runs]
  real_target, real_steps = float(np.median(to_target)), float(np.median(steps))
  predicted_target = predicted_s * real_steps if np.isfinite(real_steps) else None
  real_target = real_target if np.isfinite(real_target) else None
  # Diagnostic of the time to target's own error: each run's rows up to the target against its median row (1: the
  # target falls in steady rows; more: one-time costs after the first row, e.g. programs first compiled there).
  early = [r['time_to_target'] / (r['steps_to_target'] * r.get('median_row_s', r['seconds_per_iteration']))
           for r in runs
           if r['time_to_target'] is not None and r['steps_to_target']]
  return {'early_rows': float(np.median(early)) if early else None,
          'real_s': float(np.median(per_iteration)), 'range': (min(per_iteration), max(per_iteration)),
          'predicted_s': predicted_s, 'error': _error(predicted_s, float(np.median(per_iteration))),
          'real_target_s': real_target, 'target_range': (min(to_target), max(to_target)),
          'predicted_target_s': predicted_target, 'target_error': _error(predicted_target, real_target),
          'runs': len(runs)}


def ranking(cells: dict) -> list[str]:
  """Per condition, the pairs whose real ranges do not overlap, and whether the prediction orders them so."""
  lines = []
  for condition in FLAGS.conditions:
    names = [a for a in FLAGS.algorithms if (a, condition) in cells and cells[a, condition]['runs'] >= 2]
    for i, a in enumerate(names):
      for b in names[i + 1:]:
        (la, ha), (lb, hb) = cells[a, condition]['range'], cells[b, condition]['range']
        if ha < lb or hb < la:
          fast, slow = (a, b) if ha < lb else (b, a)
          same = cells[fast, condition]['predicted_s'] < cells[slow, condition]['predicted_s']
          lines.append(f'{condition}: {fast} < {slow}: {"same order" if same else "REVERSED by the prediction"}')
  return lines


def slow_factor() -> str:
  """The slow host's factor the predictions use and where it comes from, in words."""
  if 'slow' not in FLAGS.conditions:
    return 'no slow host'
  quotas = cpus('slow')
  factors, source = worker_factors(quotas, model_key())
  where = 'calibrate\'s compute per quota (per_cpu)' if source == 'per_cpu' else 'the quotas\' ratio'
  return f'the slow host\'s factor {factors[-1] / min(factors):.3g} ({where})'


def report(cells: dict, loads: tuple) -> str:
  pct = lambda e: '-' if e is None else f'{100 * e:+.1f}%'
  ms = lambda s: '-' if s is None else f'{1e3 * s:.1f}'
  sec = lambda s: '-' if s is None else f'{s:.2f}'
  lines = [f'{FLAGS.hosts} hosts at {FLAGS.rate_mbit:g} Mbit/s per direction, {FLAGS.cpu:g} CPU each (slow: the last '
           f'at {FLAGS.slow_cpu:g}), cpu.shares {FLAGS.cpu_weight or 1024}; {FLAGS.workload}:{FLAGS.pairs} '
           f'{" ".join(FLAGS.overrides)}, m = '
           f'{FLAGS.microbatches}, {FLAGS.num_steps} steps; profile {FLAGS.profile}; median of {FLAGS.runs} '
           f'interleaved runs per cell; load average {loads[0]:.1f} before, {loads[1]:.1f} after; {slow_factor()}', '',
           '| algorithm | hosts | real ms/it (range) | predicted | error | real s to target (range) | predicted | '
           'error |', '|---|---|---|---|---|---|---|---|']
  errors_ = []
  for (algorithm, condition), c in cells.items():
    lo, hi = c['range']
    tlo, thi = c['target_range']
    lines.append(f"| {algorithm} | {condition} | {ms(c['real_s'])} ({ms(lo)}-{ms(hi)}) | {ms(c['predicted_s'])} | "
                 f"{pct(c['error'])} | {sec(c['real_target_s'])} ({sec(tlo)}-{sec(thi)}) | "
                 f"{sec(c['predicted_target_s'])} | {pct(c['target_error'])} |")
    errors_.append(abs(c['error']))
  within = sum(e <= 0.10 for e in errors_)
  lines += ['', f'ms/it: {within} of {len(errors_)} cells within 10%; mean |error| {100 * np.mean(errors_):.1f}% '
            f'(targets: all within 10%, mean within 3%)',
            'ranking where the real ranges do not overlap: ' + ('; '.join(ranking(cells)) or 'none')]
  return '\n'.join(lines)


def draw(cells: dict, path: str) -> None:
  """Predicted against real ms/it, one point per cell with the real range as its error bar, the +-10% band."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 5))
  top = 1e3 * max(max(c['range'][1], c['predicted_s']) for c in cells.values()) * 1.1
  line = np.array([0, top])
  ax.plot(line, line, 'k-', lw=0.8)
  ax.fill_between(line, 0.9 * line, 1.1 * line, color='0.9', label='within 10%')
  for (algorithm, condition), c in cells.items():
    real, (lo, hi) = 1e3 * c['real_s'], c['range']
    ax.errorbar(real, 1e3 * c['predicted_s'], xerr=[[real - 1e3 * lo], [1e3 * hi - real]], fmt='o' if
                condition == 'equal' else 's', capsize=3, label=f'{algorithm} ({condition})')
  ax.set(xlim=(0, top), ylim=(0, top), xlabel='real ms/it (median of runs, range)', ylabel='predicted ms/it',
         title=f'{FLAGS.hosts} hosts, {FLAGS.rate_mbit:g} Mbit/s')
  ax.legend(fontsize=7, loc='upper left')
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  from waitless import config_errors as errors
  try:
    errors.require(bool(FLAGS.profile), '--profile', FLAGS.profile,
                   'required: the profile calibrate wrote on the bed')
    errors.require_int(FLAGS.hosts, '--hosts', 2, 4)
    errors.require_int(FLAGS.runs, '--runs', 1)
    for condition in FLAGS.conditions:
      errors.require(condition in CONDITIONS, '--conditions', condition, f'one of {", ".join(CONDITIONS)}')
    predicted = {(a, c): predict(a, c) for c in FLAGS.conditions for a in FLAGS.algorithms}  # a bad profile: now
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  root = FLAGS.workdir or tempfile.mkdtemp(prefix='testbed_predictions_')
  before = os.getloadavg()[0]
  runs = {key: [] for key in predicted}
  for round_ in range(FLAGS.runs):
    for condition in FLAGS.conditions:
      for algorithm in FLAGS.algorithms:
        slug = f'{algorithm.replace(":", "_")}_{condition}_{round_}'
        runs[algorithm, condition].append(run(algorithm, condition, round_, os.path.join(root, slug)))
        real = runs[algorithm, condition][-1]['seconds_per_iteration']
        print(f'round {round_} {algorithm} {condition}: {1e3 * real:.1f} ms/it (predicted '
              f'{1e3 * predicted[algorithm, condition]:.1f})', file=sys.stderr, flush=True)
  loads = (before, os.getloadavg()[0])
  cells = {key: summarize(r, predicted[key]) for key, r in runs.items()}
  print(report(cells, loads))
  if FLAGS.figure:
    draw(cells, FLAGS.figure)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({'cells': [{'algorithm': a, 'condition': c, **v} for (a, c), v in cells.items()],
                 'runs': {f'{a}|{c}': r for (a, c), r in runs.items()}, 'loads': loads, 'workdir': root,
                 'slow_factor': slow_factor(),
                 'flags': FLAGS.flag_values_dict()}, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
