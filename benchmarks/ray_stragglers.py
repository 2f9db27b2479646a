"""The parameter-server family on real Ray learners with a real straggler, beside the simulator's prediction.

  python -m benchmarks.ray_stragglers [--seeds=3 --scenarios=slowed,delayed --out=ray_stragglers.json]

P = 4 learners (`--workers`; several per learner process, as the run's plan places them: a process's learners
compute, and sleep, one after another, so a slowed learner slows its process) on a local Ray train the digits
MLP (batch 16 per job, SGD without momentum). The learning rate is chosen per algorithm from one grid for all
(`--learning_rates`; default 0.1 alone): every algorithm runs at every rate, and its row is the rate with the
shortest median time to the accuracy target (a run that misses it counted as never; chosen on the seeds it is
reported on: there are no separate tuning seeds), so that async, whose stale gradients need a smaller step at large
P, is compared at a rate that suits it. Every learner
sleeps `--base_s` per job on top of its real compute (TEST-ONLY emulated compute, `worker.DebugHooks.base_s`: on a
2-core machine, four learners' real compute would mostly measure their contention for the cores, not the
rules), and
  slowed   learner 3 sleeps `--slow_s` more per job (a persistently slower device; `--debug_slow_process`);
  delayed  at each job index, one learner drawn at random sleeps `--delay_s` once (transient; `--debug_delay`).
Algorithms: `sync` (K-sync with K = P on the server), `ksync` (K = 3), `kasync` (K = 2), `async`, `ringmaster`
(R = P). The same seeds (data order, initial model, delay draws) for every algorithm.

Measured, per run: the mean seconds per server update (measured training time / updates), the measured time
to the first evaluation (every 10 updates) at accuracy >= `--target_accuracy` and to the first metrics row at
training loss <= `--target_loss`, and the updates those took.

Predicted: the simulator (its clock, as `experiments.simulate` drives it; ideal network) with each learner's
measured job time: the median interval between consecutive pushes of learner i in the same seed's `async` run (an
async learner never waits: its interval is its compute, its sleeps and its round trip to the server) as
`stragglers.worker_factors` over the fastest learner's, the transient delays as `stragglers.delayed_workers = 1,
delay_s`, K-sync's late jobs discarded on arrival as the server does (`ray_config.server_config`). The predicted
time to target is the predicted time per update x the real run's updates to target (the simulator predicts time,
the trajectory is the run's own).

Prints one table per scenario (medians over seeds, [min, max]) and writes every run's figures to `--out`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
from absl import logging
import numpy as np

from benchmarks import cli
from waitless.experiments.harness import atomic_files
from waitless.cluster import factory as cluster_factory
from waitless.cluster import registry
from waitless.experiments.configs import digits
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import tasks
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import events
from waitless.experiments.harness.ray_runtime import ray_config
from waitless.experiments.harness.ray_runtime import worker

_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per (algorithm, scenario).')
_WORKERS = flags.DEFINE_integer('workers', 4, 'Learners P (the plan places them: several per process).')
_SCENARIOS = flags.DEFINE_list('scenarios', ['slowed', 'delayed'], 'slowed, delayed.')
_ALGORITHMS = flags.DEFINE_list('algorithms', ['sync', 'ksync,k=3', 'kasync,k=2', 'async', 'ringmaster'],
                                'Config arguments (the digits workload on the Ray runtime).')
_BASE_S = flags.DEFINE_float('base_s', 0.02, 'Seconds every learner sleeps per job (emulated compute).')
_SLOW_S = flags.DEFINE_float('slow_s', 0.06, 'slowed: extra seconds per job of learner 3.')
_DELAY_S = flags.DEFINE_float('delay_s', 0.08, 'delayed: seconds of the one learner delayed at each job index.')
_LEARNING_RATES = flags.DEFINE_list('learning_rates', ['0.1'], 'The step sizes every algorithm runs at; its '
                                     'rows are those of its best (module docstring).')
_STEPS = flags.DEFINE_list('steps', [], 'NAME=N: server updates of algorithm NAME\'s runs instead of STEPS\'s '
                           '(async=1500: a small rate needs more updates).')
_TARGET_ACCURACY = flags.DEFINE_float('target_accuracy', 0.9, 'Evaluation accuracy target.')
_TARGET_LOSS = flags.DEFINE_float('target_loss', 0.3, 'Training loss target.')
# allow_override: tests import this module and `experiments.calibrate` (its own --out) into one process.
_OUT = flags.DEFINE_string('out', '', 'JSON file for every run\'s figures ("" for none).', allow_override=True)
_FIGURE = flags.DEFINE_string('figure', '', 'PNG of the tables: real and predicted time per update and to the '
                              'accuracy target, per algorithm and scenario ("" for none).')
_FROM_JSON = flags.DEFINE_string('from_json', '', 'Print the tables (and draw --figure) from an earlier --out '
                                 'instead of running.')

SLOW_LEARNER = 3
# Server updates per run: enough for every algorithm to reach the targets (an async update takes one job).
STEPS = {'sync': 150, 'ksync': 200, 'kasync': 300, 'async': 600, 'ringmaster': 600}


def config_for(arg: str, seed: int, learning_rate: float = 0.1):
  config = digits.get_config(f'{arg},runtime=ray,workers={_WORKERS.value}')
  config.seed = seed
  config.num_steps = steps()[config.algorithm.name]
  config.optimizer.learning_rate, config.optimizer.momentum = learning_rate, 0.0
  config.eval_every, config.log_every, config.checkpoint_every = 10, 10, 10**6
  config.target_accuracy = _TARGET_ACCURACY.value
  config.progress_every_s = 1e9
  return config


def hooks_for(scenario: str) -> worker.DebugHooks:
  if scenario == 'slowed':
    return worker.DebugHooks(base_s=_BASE_S.value, slow_learner=SLOW_LEARNER, slow_s=_SLOW_S.value)
  return worker.DebugHooks(base_s=_BASE_S.value, delayed_per_job=1, delay_s=_DELAY_S.value)


def measure(config, hooks) -> dict:
  """One real run: its summary figures, its targets and, from its event log, each learner's push intervals."""
  with tempfile.TemporaryDirectory() as workdir:
    summary = driver.train_and_evaluate(config, workdir, hooks=hooks)
    rows = metrics_io.read_rows(workdir)
    lines = events.read(workdir)
  pushes = [p for line in lines for p in line['pushes'] if p[4] in ('taken', 'taken_last')]
  intervals = []
  for i in range(config.workers):
    times = np.sort([p[5] for p in pushes if p[0] == i])
    intervals.append(float(np.median(np.diff(times))) if len(times) > 2 else float('nan'))
  acc = next((r for r in rows if r.get('eval_accuracy', 0.0) >= config.target_accuracy), None)
  loss = next((r for r in rows if r['train_loss'] <= _TARGET_LOSS.value), None)
  return {'update_s': summary['measured_time'] / summary['steps'], 'steps': summary['steps'],
          'time_to_accuracy': None if acc is None else acc['measured_time'], 'updates_to_accuracy': acc and acc['step'],
          'time_to_loss': None if loss is None else loss['measured_time'], 'updates_to_loss': loss and loss['step'],
          'final_accuracy': summary['final_eval_accuracy'], 'push_intervals_s': intervals}


def predicted_update_s(config, scenario: str, intervals) -> float:
  """The simulator's mean time per update for `config` with the learners' measured job times."""
  c = ray_config.server_config(config)
  c.runtime = 'spmd'
  fastest = float(np.nanmin(intervals))
  c.stragglers.kind, c.stragglers.base_s = 'constant', fastest / c.microbatches
  if scenario == 'slowed':
    c.stragglers.worker_factors = tuple(float(t / fastest) for t in intervals)
  else:  # the medians leave the rare delays out: every learner at the fastest's time, plus the delays
    c.stragglers.delayed_workers, c.stragglers.delay_s = 1, _DELAY_S.value
  c.network.kind = 'ideal'
  # The simulator's clock as `experiments.simulate` drives it (that program's module defines flags: not imported).
  clock = cluster_factory.make_clock(c, registry.time_rule(c), tasks.model_bytes(c))
  done = 0
  while done < config.num_steps:
    done += len(clock.next_block(min(1000, config.num_steps - done)).duration)
  return clock.sim_time / done


def run_all() -> list[dict]:
  """Every (scenario, seed, algorithm) run, `async` first in each seed (it measures the speeds)."""
  import ray
  driver.start_local(num_cpus=2)
  results = []
  for scenario in _SCENARIOS.value:
    hooks = hooks_for(scenario)
    for seed in range(_SEEDS.value):
      speeds = None
      for arg in sorted(_ALGORITHMS.value, key=lambda a: a != 'async'):  # async first: it measures the speeds
        for lr in learning_rates():
          config = config_for(arg, seed, lr)
          begin = time.time()
          run = measure(config, hooks)
          if arg == 'async' and speeds is None:
            speeds = run['push_intervals_s']
          run.update(scenario=scenario, seed=seed, algorithm=arg, learning_rate=lr,
                     predicted_update_s=predicted_update_s(config, scenario, speeds))
          results.append(run)
          print(f'{scenario} seed {seed} {arg} lr {lr:g}: {run["update_s"] * 1e3:.1f} ms per update (predicted '
                f'{run["predicted_update_s"] * 1e3:.1f}), time to acc {run["time_to_accuracy"]} '
                f'({time.time() - begin:.0f} s)', flush=True)
  ray.shutdown()
  return results


def steps() -> dict[str, int]:
  """STEPS with --steps' overrides."""
  out = dict(STEPS)
  for value in _STEPS.value:
    name, _, n = value.partition('=')
    if name not in STEPS or not n.isdigit() or int(n) < 1:
      cli.refuse(f'--steps={",".join(_STEPS.value)} is not allowed: each must be NAME=N, N >= 1 and NAME one of '
                 f'{", ".join(STEPS)}')
    out[name] = int(n)
  return out


def learning_rates() -> list[float]:
  try:
    rates = [float(v) for v in _LEARNING_RATES.value]
  except ValueError:
    rates = []
  if not rates or min(rates) <= 0:
    cli.refuse(f'--learning_rates={",".join(_LEARNING_RATES.value)} is not allowed: must be numbers > 0')
  return rates


def best_rates(results: list[dict]) -> list[dict]:
  """The runs at each (scenario, algorithm)'s best learning rate: the shortest median time to the accuracy target
  over seeds, a missed target counted as never (a rate that reaches it on more seeds wins first)."""
  chosen = []
  for key in dict.fromkeys((r['scenario'], r['algorithm']) for r in results):
    mine = [r for r in results if (r['scenario'], r['algorithm']) == key]
    by_rate = {}
    for r in mine:
      by_rate.setdefault(r.get('learning_rate', 0.1), []).append(r)

    def score(rate):
      times = [r['time_to_accuracy'] for r in by_rate[rate]]
      reached = [t for t in times if t is not None]
      return (-len(reached), float(np.median(times)) if len(reached) == len(times) else float('inf'),
              float(np.median(reached)) if reached else float('inf'))

    chosen += by_rate[min(by_rate, key=score)]
  return chosen


def draw(results: list[dict], path: str) -> None:
  """Per scenario: real and predicted ms per update, and seconds to the accuracy target (medians, min-max bars)."""
  import matplotlib
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  scenarios = list(dict.fromkeys(r['scenario'] for r in results))
  algorithms = list(dict.fromkeys(r['algorithm'] for r in results))
  fig, axes = plt.subplots(2, len(scenarios), figsize=(5.5 * len(scenarios), 7), squeeze=False)
  x = np.arange(len(algorithms))
  for col, scenario in enumerate(scenarios):
    for row, (real_key, label) in enumerate((('update_s', 'ms per server update'),
                                             ('time_to_accuracy', 's to accuracy target'))):
      ax = axes[row, col]
      for shift, predicted in ((-0.2, False), (0.2, True)):
        medians, lows, highs = [], [], []
        for arg in algorithms:
          runs = [r for r in results if r['scenario'] == scenario and r['algorithm'] == arg]
          if real_key == 'update_s':
            values = [(r['predicted_update_s'] if predicted else r['update_s']) * 1e3 for r in runs]
          else:
            values = [(r['updates_to_accuracy'] * r['predicted_update_s'] if predicted else r['time_to_accuracy'])
                      for r in runs if r['updates_to_accuracy'] is not None]
          values = values or [np.nan]
          medians.append(np.median(values))
          lows.append(np.median(values) - min(values))
          highs.append(max(values) - np.median(values))
        ax.bar(x + shift, medians, 0.4, yerr=[lows, highs], capsize=3,
               label='simulator, measured speeds' if predicted else 'real (Ray, 4 learners)',
               color='tab:orange' if predicted else 'tab:blue')
      ax.set_xticks(x, algorithms, rotation=20)
      ax.set_yscale('log')
      ax.set_ylabel(label)
      ax.set_title(f'{scenario}: {label}')
      ax.legend(fontsize=8)
  fig.tight_layout()
  atomic_files.save_figure(fig, path, dpi=110)
  plt.close(fig)


def repredict(results: list[dict]) -> list[dict]:
  """The runs of an earlier --out with their predictions made again (by this simulator) from the same speeds."""
  for r in results:
    speeds = next(a['push_intervals_s'] for a in results
                  if a['scenario'] == r['scenario'] and a['seed'] == r['seed'] and a['algorithm'] == 'async')
    r['predicted_update_s'] = predicted_update_s(config_for(r['algorithm'], r['seed'], r.get('learning_rate', 0.1)),
                                                 r['scenario'], speeds)
  return results


def reached(runs, key: str = 'time_to_accuracy') -> str:
  """The median [min, max] of the runs that reached the target, and how many did when some did not."""
  times = [r[key] for r in runs]
  hit = sum(t is not None for t in times)
  return cli.spread(times) + ('' if hit == len(times) or not hit else f' ({hit} of {len(times)})')


def print_tables(results: list[dict]) -> None:
  grid = results
  results = best_rates(results)
  for scenario in list(dict.fromkeys(r['scenario'] for r in results)):
    slowdown = (f'learner {SLOW_LEARNER} +{_SLOW_S.value * 1e3:g} ms' if scenario == 'slowed'
                else f'one learner per job index +{_DELAY_S.value * 1e3:g} ms')
    print(f'\n{scenario}: {_WORKERS.value} learners, base {_BASE_S.value * 1e3:g} ms per job, {slowdown}; '
          f'{len({r["seed"] for r in results})} seeds, median [min, max]')
    print(f'| algorithm | learning rate | ms per update | predicted | predicted / real | time to acc >= '
          f'{_TARGET_ACCURACY.value} (s) | predicted | time to loss <= {_TARGET_LOSS.value} (s) | final acc |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for arg in list(dict.fromkeys(r['algorithm'] for r in results)):
      runs = [r for r in results if r['scenario'] == scenario and r['algorithm'] == arg]
      real = [r['update_s'] * 1e3 for r in runs]
      pred = [r['predicted_update_s'] * 1e3 for r in runs]
      ratio = [p / q for p, q in zip(pred, real)]
      pred_acc = [None if r['updates_to_accuracy'] is None else r['updates_to_accuracy'] * r['predicted_update_s']
                  for r in runs]
      if not runs:
        continue
      print(f'| {arg} | {runs[0].get("learning_rate", 0.1):g} | {cli.spread(real)} | {cli.spread(pred)} | '
            f'{cli.spread(ratio)} | {reached(runs)} | {cli.spread(pred_acc)} | {reached(runs, "time_to_loss")} | '
            f'{cli.spread([r["final_accuracy"] for r in runs])} |')
    rates = sorted({r.get('learning_rate', 0.1) for r in grid})
    if len(rates) > 1:
      print(f'\nThe grid ({scenario}): time to acc >= {_TARGET_ACCURACY.value} (s) per learning rate')
      print('| algorithm | ' + ' | '.join(f'lr {lr:g}' for lr in rates) + ' |')
      print('| --- |' + ' --- |' * len(rates))
      for arg in list(dict.fromkeys(r['algorithm'] for r in grid)):
        cells = [reached([r for r in grid if r['scenario'] == scenario and r['algorithm'] == arg
                          and r.get('learning_rate', 0.1) == lr]) for lr in rates]
        print(f'| {arg} | ' + ' | '.join(cells) + ' |')


def main(argv):
  cli.no_positionals(argv)
  if _OUT.value:
    cli.output_file(_OUT.value, '--out')
  learning_rates()
  steps()
  logging.set_verbosity(logging.ERROR)
  results = cli.load_or_run(_FROM_JSON.value, run_all, _OUT.value, loaded=repredict)
  print_tables(results)
  if _FIGURE.value:
    draw(best_rates(results), _FIGURE.value)


if __name__ == '__main__':
  cli.run(main)
