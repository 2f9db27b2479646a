"""Runs only the cluster simulator for a config: no model compilation, no data loading beyond one example.

  python -m waitless.experiments.simulate --config=experiments/configs/digits.py:sync --iterations=1000
  python -m waitless.experiments.simulate --config=experiments/configs/digits.py:local_sgd \
      --config.stragglers.kind=exponential --config.stragglers.rate=100 --model_bytes=4e6

Prints one JSON object: `algorithm`, `workers`, `iterations`, `sim_time`, `mean_iteration_time`,
`mean_staleness`, `idle_fraction` (idle worker-seconds / (P x sim_time)), `idle_fraction_per_worker`,
`bytes_communicated`, `bytes_per_iteration`, `model_bytes`, `profile` and `host_s` (the cluster profile and the
host time per iteration the clock charged), `measurements` (what the time rule declares in
its `reports`, reduced over the run as declared: e.g. K-async's mean `k` and `max_staleness`, WAGMA's summed
`behind`), and `simulator_us_per_iteration` (host cost of the simulation itself).
The time rule is the algorithm's own (`cluster.registry.time_rule(config)`); with `runtime=ray`, that of what the
Ray runtime's server runs (`ray_config.server_config`: sync as K-sync with K = P, K-sync's and K-batch-sync's late
jobs discarded on arrival).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Optional

from absl import app
from absl import flags
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.cluster import clock as clock_lib
from waitless.cluster import factory as cluster_factory
from waitless.cluster import limits
from waitless.cluster import network as network_lib
from waitless.cluster import stacks
from waitless.experiments import config_paths

_CONFIG = config_paths.config_flag()
flags.declare_key_flag('config')  # in `--help`
_ITERATIONS = flags.DEFINE_integer('iterations', None, 'Iterations to simulate (default: config.num_steps).')
_MODEL_BYTES = flags.DEFINE_float('model_bytes', None,
                                  'Bytes of one model copy; default: counted from the config\'s model.')
_BLOCK = flags.DEFINE_integer('block', 1000, 'Iterations drawn per clock call.')


def model_bytes(config: ml_collections.ConfigDict) -> float:
  """Bytes of the config's model parameters, from shapes only (`tasks.model_bytes`: nothing is compiled)."""
  from waitless.experiments.harness import tasks  # only when --model_bytes is not given
  try:
    return tasks.model_bytes(config)
  except errors.ConfigError as e:
    raise errors.ConfigError(e.field, e.value, f'{e.allowed}; or pass --model_bytes to skip the data') from e


def simulate(config: ml_collections.ConfigDict, iterations: Optional[int] = None,
             nbytes: Optional[float] = None, block: int = 1000) -> dict[str, Any]:
  """Validates `config` (its cluster and algorithm fields), drives its algorithm's time rule for `iterations`,
  returns the statistics. The cluster profile, if any, is read once (`cluster.factory.validate`'s cost model).

  Raises:
    errors.ConfigError: a bad config field (before anything runs).
  """
  spec = registry.get(config.algorithm.name)
  name = config.algorithm.name
  limits.check_workers(config, ray=config.get('runtime') == 'ray')  # before any field reads P
  if iterations is not None:
    errors.require_int(iterations, '--iterations', 1)
  errors.require_int(block, '--block', 1)
  # What the clock will hold, before anything (the straggler model, the rule) allocates per worker.
  steps = iterations if iterations is not None else config.get('num_steps')
  limits.check_clock_memory(config, min(block, steps) if errors.is_int(steps) and steps >= 1 else block, '--block',
                            block_value=block)
  cost = cluster_factory.validate(config)
  errors.require(config.stragglers.kind != cluster_factory.MEASURED, 'stragglers.kind',
                 cluster_factory.MEASURED, 'a measured run has no simulated clock to simulate; give a compute model '
                 '(e.g. constant with worker_factors)')
  spec.validate(config)
  if iterations is None and config.get('num_epochs') is not None:  # a duration in epochs: the split's size
    from waitless.data import registry as data_registry
    from waitless.experiments.harness import duration
    config = duration.resolve_num_steps(config, data_registry.make_dataset(config).train_size)
  iterations = config.num_steps if iterations is None else iterations
  errors.require_int(iterations, 'iterations', 1)
  nbytes = model_bytes(config) if nbytes is None else float(nbytes)
  errors.require_number(nbytes, 'model_bytes', 'must be a number >= 0', lambda v: v >= 0)
  if config.get('runtime') == 'ray':  # the rule of what the Ray runtime's server does (late jobs discarded on arrival)
    from waitless.experiments.harness.ray_runtime import ray_config
    config = ray_config.server_config(config)
  clock = cluster_factory.make_clock(config, registry.time_rule(config), nbytes, cost)

  p = config.workers
  idle = np.zeros(p)
  staleness_sum, bytes_sum, measured = 0.0, 0.0, {}
  reductions = clock.rule.reports
  begin = time.perf_counter()
  done = 0
  while done < iterations:
    b = clock.next_block(min(block, iterations - done))
    done += len(b.duration)
    idle += b.idle.sum(axis=0)
    staleness_sum += float(b.mean_staleness.sum())
    bytes_sum += float(b.bytes_communicated.sum())
    for key, values in b.measurements.items():
      if reductions[key] == 'max':
        measured[key] = max(measured.get(key, -np.inf), float(values.max()))
      else:
        measured[key] = measured.get(key, 0.0) + float(values.sum())
  host_seconds = time.perf_counter() - begin
  sim_time = clock.sim_time
  per_worker = idle / sim_time if sim_time > 0 else np.zeros(p)
  return {
      'algorithm': name,
      'rule': type(clock.rule).__name__,
      'workers': p,
      'iterations': done,
      'sim_time': sim_time,
      'mean_iteration_time': sim_time / done,
      'mean_staleness': staleness_sum / done,
      'idle_fraction': float(per_worker.mean()),
      'idle_fraction_per_worker': [round(float(x), 6) for x in per_worker],
      'bytes_communicated': bytes_sum,
      'bytes_per_iteration': bytes_sum / done,
      'model_bytes': nbytes,
      'measurements': {k: v / done if reductions[k] == 'mean' else v for k, v in measured.items()},
      'stragglers': config.stragglers.kind,
      'network': ('profile' if isinstance(clock.network, (network_lib.Collectives, stacks.Stack))
                  else config.network.kind),
      'profile': config.cluster.profile,
      'host_s': clock.host_s,
      'simulator_us_per_iteration': 1e6 * host_seconds / done,
  }


def _stopped(signum, frame) -> None:
  """Ctrl-C or SIGTERM: one line, exit 130 or 143 (simulate prints its JSON only at the end: nothing is lost)."""
  del frame
  sys.stdout.flush()
  sys.stderr.write(f'stopped by {signal.Signals(signum).name}: nothing simulated is printed; rerun to simulate\n')
  sys.stderr.flush()
  os._exit(143 if signum == signal.SIGTERM else 130)


def main(argv):
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, _stopped)
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _CONFIG.value is None:
    raise app.UsageError('--config is required, e.g. --config=experiments/configs/digits.py:sync')
  from ml_collections import config_flags
  from waitless.experiments.configs import arguments
  arguments.apply_flag_rules(_CONFIG.value, config_flags.get_override_values(flags.FLAGS['config']))
  try:
    result = simulate(_CONFIG.value, _ITERATIONS.value, _MODEL_BYTES.value, _BLOCK.value)
  except (errors.ConfigError, clock_lib.StalledError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: config_paths.parse_flags(argv, _CONFIG))
