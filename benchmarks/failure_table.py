"""Every algorithm with a worker that fails for good: does it go on and reach the target, or stop, and when?

  python -m benchmarks.failure_table [--workdir=/tmp/failures --fail_at_s=0.1 --sim_time=3 --only=sync,wagma]

Digits, 8 workers on 8 devices, constant 10 ms micro-batches, worker 3 down for good at `fail_at_s` simulated
seconds. Every run gets the iterations its own clock needs to reach `sim_time` simulated seconds
(`sim_budget.steps_for_sim_time`: an asynchronous iteration is one gradient, so async needs ~8x sync's), so every
algorithm meets the failure. Each algorithm trains in its own sub-workdir (in this process; finished runs are
reused); the table
gives, per algorithm: survives (and its simulated time to the target accuracy) or the one line it stopped with.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ['XLA_FLAGS'] = ' '.join(
    [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    + ['--xla_force_host_platform_device_count=8'])

from absl import app
from absl import flags
from absl import logging

from benchmarks import cli
from waitless.cluster import registry
from waitless.experiments.comparison import sim_budget
from waitless.experiments.configs import digits
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import train

ARGS = {'ksync': 'ksync,k=6', 'kasync': 'kasync,k=4', 'kbatch_sync': 'kbatch_sync,k=4',
        'kbatch_async': 'kbatch_async,k=4', 'adasync': 'adasync,k0=4',
        # One gradient per update, up to ~P updates stale: digits' momentum 0.9 does not learn (failure or not).
        'async': 'async,optimizer.momentum=0.0', 'ringmaster': 'ringmaster,optimizer.momentum=0.0'}
# Rows beyond one per algorithm: WAGMA goes on without the lost worker between global averages; with tau
# beyond the run there is none after the failure.
EXTRA_ROWS = {'wagma (tau > run)': 'wagma,sync_every=1000000'}


def rows(only: list[str]) -> dict[str, str]:
  """Row label -> config argument, in table order; `only`: these labels (all when empty)."""
  table = {name: ARGS.get(name, name) for name in registry.names()}
  table.update(EXTRA_ROWS)
  unknown = sorted(set(only) - set(table))
  if unknown:
    raise app.UsageError(f'--only: unknown row(s) {unknown}; choose from {sorted(table)}')
  return {label: arg for label, arg in table.items() if not only or label in only}


def main(argv):
  cli.no_positionals(argv)
  logging.set_verbosity(logging.WARNING)
  print(f'worker 3 of 8 fails for good at {_FAIL_AT.value} s; {_SIM_TIME.value:g} simulated seconds per run; '
        f'target accuracy {_TARGET.value}\n')
  print('| algorithm | outcome | simulated time to target | final accuracy |\n| --- | --- | ---: | ---: |')
  for name, arg in rows(_ONLY.value).items():
    config = digits.get_config(arg)
    config.stragglers.fail_worker, config.stragglers.fail_at_s = 3, _FAIL_AT.value
    config.target_accuracy = _TARGET.value
    steps = sim_budget.steps_for_sim_time(config, _SIM_TIME.value, max_steps=100_000)
    for field, value in sim_budget.even_blocks(config, steps, evals=12).items():  # 12 evaluations, whole rounds
      config[field] = value
    workdir = os.path.join(_WORKDIR.value, arg.replace(',', '_').replace('=', '-'))
    try:
      summary = train.train_and_evaluate(config, workdir)
    except recorder_lib.ClusterStalled as e:
      print(f'| {name} | stops: "{str(e).split(": the run cannot continue")[0]}" | - | - |', flush=True)
      continue
    hit = summary['time_to_target']
    print(f'| {name} | survives ({summary["steps"]} steps, {summary["sim_time"]:.2f} s) | '
          f'{"%.2f s" % hit if hit is not None else "not reached"} | {summary["final_eval_accuracy"]:.4f} |',
          flush=True)


if __name__ == '__main__':
  _WORKDIR = flags.DEFINE_string('workdir', '/tmp/waitless_failures', 'Where the runs go (reused when rerun).')
  _FAIL_AT = flags.DEFINE_float('fail_at_s', 0.1, 'Simulated second at which worker 3 fails for good (before any '
                                 'algorithm reaches the target).')
  _SIM_TIME = flags.DEFINE_float('sim_time', 3.0, 'Simulated seconds per run (the failure must come before).')
  _TARGET = flags.DEFINE_float('target_accuracy', 0.9, 'Target accuracy of the time-to-target column.')
  _ONLY = flags.DEFINE_list('only', [], 'Only these rows (algorithm names, or "wagma (tau > run)"); all if empty.')
  cli.run(main)
