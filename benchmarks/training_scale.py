"""Training at scale on this machine: the cost of a worker-iteration and the memory as P grows (workers per device).

  python -m benchmarks.training_scale                     # MNIST-1D and digits, P = 8, 64, 256, 3 seeds as replicas
  python -m benchmarks.training_scale --workloads=mnist1d --workers=8,256 --algorithms='sync;kasync,k=4'

Each cell is one `experiments.main` process (`--seeds=N`: the seeds as the replicas of one program) of the
workload at P workers on 8 CPU devices (P / 8 workers vmapped per device), `--batch` examples per worker (the same
at every P: the work per worker-iteration is the same), `stragglers=heterogeneous` on `commodity_10gbe`, plain SGD
at `--learning_rate`. Printed: the steady-state wall seconds per worker-iteration (from the metrics rows' wall
times, a quarter of the way in to the last row but one: start-up and compilation left out) and its ratio to P =
8's, the whole process's wall time, and its peak resident memory. The per-worker batch is kept small so that P =
256 workers have their own examples (MNIST-1D: 4,000 training sequences, digits 1,437 images).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from benchmarks import cli
from benchmarks import harness_overhead
from waitless import config_errors as errors
from waitless.experiments.harness import metrics_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKLOADS = flags.DEFINE_list('workloads', ['mnist1d', 'digits'], 'Workload config files (experiments/configs/).')
_WORKERS = flags.DEFINE_list('workers', ['8', '64', '256'], 'Cluster sizes P (multiples of 8).')
_ALGORITHMS = flags.DEFINE_string('algorithms', 'sync;local_sgd;wagma;dpsgd;kasync,k=4',
                                  'Semicolon-separated config arguments, one per algorithm.')
_BATCH = flags.DEFINE_integer('batch', 4, 'Examples per worker per iteration (at every P).')
_STEPS = flags.DEFINE_integer('steps', 400, 'Iterations of each run.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds, trained as the replicas of one program.')
_LEARNING_RATE = flags.DEFINE_float(
    'learning_rate', 0.05, 'Plain SGD step size of every run (momentum 0): small enough that no algorithm diverges '
    'on 4 examples per worker at 256 workers; what an iteration costs does not depend on it.')


def run_cell(workload: str, algorithm: str, workers: int) -> dict:
  """One `experiments.main` process: {'us_per_worker_iteration', 'wall_s', 'peak_mb'}."""
  steps = _STEPS.value
  arg = (f'{algorithm},stragglers=heterogeneous,workers={workers},devices=8,batch_size={_BATCH.value},'
         f'num_steps={steps},eval_every={steps},checkpoint_every={steps},log_every=10')
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, '-m', 'waitless.experiments.main', f'--config=experiments/configs/{workload}.py:{arg}',
               '--config.cluster.profile=commodity_10gbe', f'--config.optimizer.learning_rate={_LEARNING_RATE.value}',
               '--config.optimizer.momentum=0.0', f'--seeds={_SEEDS.value}', f'--workdir={workdir}',
               '--compilation_cache_dir=']
    begin = time.time()
    process = cli.track(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True))
    try:
      _, status, usage = os.wait4(process.pid, 0)
    except BaseException:  # Ctrl-C, SIGTERM: the run stops before its workdir is removed
      cli.stop_children()
      raise
    wall = time.time() - begin
    if status:
      raise SystemExit(f'{workload} {arg}: exit status {status >> 8}: {process.stderr.read()[-1500:]}')
    rows = metrics_io.read_rows(os.path.join(workdir, 'seed0'))
  rate = harness_overhead.steady_rate([r['step'] for r in rows], [r['wall_time'] for r in rows])
  return {'us_per_worker_iteration': 1e6 / (rate * workers), 'wall_s': wall, 'peak_mb': usage.ru_maxrss / 1024}


def main(argv):
  cli.no_positionals(argv)
  sizes = cli.int_list(_WORKERS.value, '--workers', minimum=8)
  errors.require(all(p % 8 == 0 for p in sizes), '--workers', ','.join(_WORKERS.value),
                 'must be multiples of 8 (the runs have 8 CPU devices)')
  for flag, value in (('--batch', _BATCH.value), ('--seeds', _SEEDS.value)):
    errors.require_int(value, flag, 1)
  errors.require_int(_STEPS.value, '--steps', 40, why='the steady rate is read from metrics rows, one every 10 steps')
  errors.require(_LEARNING_RATE.value > 0, '--learning_rate', _LEARNING_RATE.value, 'must be > 0')
  algorithms = [a.strip() for a in _ALGORITHMS.value.split(';') if a.strip()]
  errors.require(bool(algorithms), '--algorithms', _ALGORITHMS.value,
                 'must name one or more config arguments, separated by semicolons')
  from waitless.experiments.comparison import plan as compare_plan
  for workload in _WORKLOADS.value:  # each cell's config, before the first run: a typo is news now
    path = os.path.join(ROOT, 'waitless', 'experiments', 'configs', f'{workload}.py')
    errors.require(os.path.isfile(path), '--workloads', workload,
                   'must name config files in waitless/experiments/configs/')
    module = compare_plan.load_config_module(path)
    for algorithm in algorithms:
      try:
        module.get_config(algorithm)
      except errors.ConfigError as e:
        raise errors.ConfigError('--algorithms', algorithm, str(e)) from None
  print(f'{_SEEDS.value} seeds as replicas, {_BATCH.value} examples per worker, {_STEPS.value} iterations, 8 CPU '
        f'devices; us per worker-iteration (x P={sizes[0]}'"'"'s), process wall s, peak MB')
  for workload in _WORKLOADS.value:
    print(f'\n| {workload} | ' + ' | '.join(f'P = {p}' for p in sizes) + ' |')
    print('| --- |' + ' ---: |' * len(sizes))
    for algorithm in [a.strip() for a in _ALGORITHMS.value.split(';') if a.strip()]:
      cells, base = [], None
      for p in sizes:
        m = run_cell(workload, algorithm, p)
        base = m['us_per_worker_iteration'] if base is None else base
        cells.append(f'{m["us_per_worker_iteration"]:.1f} us ({m["us_per_worker_iteration"] / base:.2f}x), '
                     f'{m["wall_s"]:.0f} s, {m["peak_mb"]:.0f} MB')
      print(f'| {algorithm} | ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
  cli.run(main)
