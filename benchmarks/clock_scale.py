"""The simulated clock's cost as the cluster grows: every algorithm at P = 8 ... 4,096 workers.

  python -m benchmarks.clock_scale                                  # every algorithm, P = 8, 64, 256, 1024, 4096
  python -m benchmarks.clock_scale --algorithms=sync,wagma --workers=8,1024

For each algorithm and P: the clock of the quickstart's workload and stragglers (MNIST-1D on `commodity_10gbe`,
`stragglers=heterogeneous`: a quarter of the workers twice as slow, one random worker three calls late per
iteration; the algorithm's defaults, WAGMA's groups sqrt(P)), driven for about `--worker_iterations` worker-
iterations in draws of `--draw` iterations as the training loop draws them. Prints the host microseconds per
worker-iteration, its ratio to P = 8's, and the clock's peak memory (numpy's allocations, `tracemalloc`) during the
run; a P an algorithm cannot take is printed with the one-line reason its config check gives.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from benchmarks import cli
from waitless import config_errors as errors
from waitless.cluster import factory as cluster_factory
from waitless.cluster import registry
from waitless.experiments import simulate
from waitless.experiments.configs import mnist1d

_WORKERS = flags.DEFINE_list('workers', ['8', '64', '256', '1024', '4096'], 'Cluster sizes P.')
_ALGORITHMS = flags.DEFINE_list('algorithms', [], 'Algorithms (default: every registered one).')
_WORKER_ITERATIONS = flags.DEFINE_integer('worker_iterations', 400_000, 'About this many worker-iterations per '
                                          'algorithm and P (at least `--min_iterations` iterations).')
_MIN_ITERATIONS = flags.DEFINE_integer('min_iterations', 100, 'The fewest iterations per algorithm and P.')
_BLOCK = flags.DEFINE_integer('draw', 30, 'Iterations per clock draw (the quickstart draws blocks of 3 to 48).')
_PROFILE = flags.DEFINE_string('profile', 'commodity_10gbe', 'Cluster profile.')


def config_for(algorithm: str, workers: int):
  """The quickstart's workload and stragglers at `workers` workers (8 devices: workers per device P / 8)."""
  config = mnist1d.get_config(f'{algorithm},stragglers=heterogeneous,workers={workers},devices=8')
  config.cluster.profile = _PROFILE.value
  return config


def measure(algorithm: str, workers: int, iterations: int, block: int) -> dict:
  """{'us_per_worker_iteration', 'peak_mb', 'seconds'} of `iterations` of the algorithm's clock at `workers`."""
  config = config_for(algorithm, workers)
  tracemalloc.start()
  begin = time.perf_counter()
  result = simulate.simulate(config, iterations, block=block)
  seconds = time.perf_counter() - begin
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return {'us_per_worker_iteration': 1e6 * seconds / (result['iterations'] * workers), 'peak_mb': peak / 1e6,
          'seconds': seconds, 'mean_iteration_time': result['mean_iteration_time']}


def main(argv):
  cli.no_positionals(argv)
  sizes = cli.int_list(_WORKERS.value, '--workers', minimum=1)
  names = _ALGORITHMS.value or list(registry.names())
  unknown = [n for n in names if n not in registry.names()]
  errors.require(not unknown, '--algorithms', ','.join(_ALGORITHMS.value),
                 f'unknown: {", ".join(unknown)}; known: {", ".join(registry.names())}')
  for flag, value in (('--worker_iterations', _WORKER_ITERATIONS.value), ('--min_iterations', _MIN_ITERATIONS.value),
                      ('--draw', _BLOCK.value)):
    errors.require_int(value, flag, 1)
  try:  # an unknown profile refuses every cell: news before the table
    cluster_factory.validate(config_for('sync', 8))
  except errors.ConfigError as e:
    raise errors.ConfigError('--profile', _PROFILE.value, e.allowed or str(e)) from None
  print(f'clock of MNIST-1D on {_PROFILE.value}, stragglers=heterogeneous; about {_WORKER_ITERATIONS.value:,} '
        f'worker-iterations per cell, blocks of {_BLOCK.value}')
  print(f'{"algorithm":<18}' + ''.join(f'{"P=" + str(p):>24}' for p in sizes))
  print(f'{"":<18}' + ''.join(f'{"us/w-it (x P=8) MB":>24}' for _ in sizes))
  for name in names:
    cells, base = [], None
    for p in sizes:
      iterations = max(_MIN_ITERATIONS.value, _WORKER_ITERATIONS.value // p)
      try:
        m = measure(name, p, iterations, _BLOCK.value)
      except errors.ConfigError as e:
        cells.append(f'{"refused":>24}')
        print(f'  {name} at P={p}: {e}', file=sys.stderr)
        continue
      base = m['us_per_worker_iteration'] if base is None else base
      ratio = m['us_per_worker_iteration'] / base
      cells.append(f'{m["us_per_worker_iteration"]:>9.3f} ({ratio:>4.2f}x) {m["peak_mb"]:>6.1f}')
    print(f'{name:<18}' + ''.join(cells), flush=True)


if __name__ == '__main__':
  cli.run(main)
