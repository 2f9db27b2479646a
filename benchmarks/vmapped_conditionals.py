"""What a real conditional saves when workers are vmapped: local SGD (H = 8), 8 workers on 1 device.

With --devices=D > 1 the workers are spread over D forced host CPU devices (P/D vmapped per device), so the
skipped all-reduce is a real cross-device collective.

  python -m benchmarks.vmapped_conditionals [--workers=8 --devices=1 --local_steps=8 --repeats=30]

Times the harness's jitted block step (digits MLP, batch 16 per worker, 10 iterations per call: not whole rounds
of H, so the per-iteration program runs; a block of whole rounds has no conditional at all) twice in one
process: with the replicated step number passed to `tx.update` (the averaging all-reduce is a conditional, run
once per H iterations) and with a per-worker counter instead (what the harness did before the core contract:
under vmap `lax.cond` becomes a select and the all-reduce runs on every iteration). Prints the median
seconds per iteration of each and their ratio.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _arg in sys.argv:  # before jax initialises: as many host CPU devices as asked for
  if _arg.startswith('--devices='):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_force_host_platform_device_count={_arg.split("=", 1)[1]}')

from absl import flags
import jax
import numpy as np
import optax

from benchmarks import cli
from waitless.experiments.configs import digits
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup

_WORKERS = flags.DEFINE_integer('workers', 8, 'Workers.')
_DEVICES = flags.DEFINE_integer('devices', 1, 'Devices the workers are vmapped over (CPU: forced host devices).')
_LOCAL_STEPS = flags.DEFINE_integer('local_steps', 8, 'H of local SGD.')
_REPEATS = flags.DEFINE_integer('repeats', 30, 'Timed calls of the block step per variant.')
_BLOCK = 10  # not a multiple of H: the per-iteration program (whole rounds compile without a conditional)


def _without_step(tx):
  def update(grads, state, params=None, *, step=None, **extra):
    del step
    return tx.update(grads, state, params, **extra)
  return optax.GradientTransformationExtraArgs(tx.init, update)


def seconds_per_iteration(per_worker_predicate: bool) -> float:
  config = digits.get_config(f'local_sgd,local_steps={_LOCAL_STEPS.value}')
  config.workers, config.devices, config.steps_per_call = _WORKERS.value, _DEVICES.value, _BLOCK
  run = setup.build(config)
  if per_worker_predicate:
    run.tx = _without_step(run.tx)
  state = setup.init_state(run)
  _, nbytes = setup.param_count_and_bytes(state.params)
  clock = setup.clock_for(run, nbytes)
  inputs, _ = inputs_lib.block_inputs(run, clock.next_block(_BLOCK), np.zeros(config.workers, np.int64), 0)
  step = block_step_lib.BlockStep(run)
  state, out = step(state, *inputs)  # compile
  jax.block_until_ready(out)
  times = []
  for _ in range(_REPEATS.value):
    begin = time.perf_counter()
    state, out = step(state, *inputs)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - begin)
  return float(np.median(times)) / _BLOCK


def main(argv):
  cli.no_positionals(argv)
  real = seconds_per_iteration(per_worker_predicate=False)
  select = seconds_per_iteration(per_worker_predicate=True)
  print(f'local SGD H={_LOCAL_STEPS.value}, {_WORKERS.value} workers on {_DEVICES.value} '
        f'{jax.devices()[0].platform} device(s), '
        f'digits MLP, median of {_REPEATS.value} calls of {_BLOCK} iterations')
  print(f'{"predicate":<36}{"us/iteration":>14}')
  print(f'{"per-worker counter (before: select)":<36}{1e6 * select:>14.1f}')
  print(f'{"replicated step (after: conditional)":<36}{1e6 * real:>14.1f}')
  print(f'ratio before/after: {select / real:.2f}x')


if __name__ == '__main__':
  cli.run(main)
