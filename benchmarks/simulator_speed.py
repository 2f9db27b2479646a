"""How fast the cluster simulator is, and what share of a training step it costs.

  python -m benchmarks.simulator_speed                    # 100,000 iterations of 64 workers per rule
  python benchmarks/simulator_speed.py --iterations=20000 --rules=wagma,nonblocking

Prints, for every rule family (64 workers, exponential compute times, alpha-beta network, blocks of 1000
iterations as the training loop takes them): the seconds to simulate `--iterations` iterations against the
target (< 2 s for 100,000), the microseconds per iteration, and that as a share of one jitted training step
of the digits MLP (8 workers x batch 16, per-worker gradients, mean, SGD with momentum) measured in the same
run: the simulator's overhead on a small real step.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import cli
from waitless.cluster.rules import adasync
from waitless.cluster.rules import dasgd
from waitless.cluster.rules import dpsgd
from waitless.cluster.rules import kasync
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from waitless.cluster.rules import ksync
from waitless.cluster.rules import lap_sgd
from waitless.cluster.rules import local_sgd
from waitless.cluster.rules import nonblocking
from waitless.cluster.rules import sync
from waitless.cluster.rules import wagma
from waitless.cluster import factory
from waitless.experiments.configs import digits
from waitless.experiments.harness import measure
from waitless.models import registry as model_registry



def _clock(rule, workers: int):
  config = digits.get_config('sync')
  config.workers = workers
  config.stragglers.kind = 'exponential'
  config.stragglers.rate = 100.0
  config.network.kind = 'alpha_beta'
  factory.validate(config)
  return factory.make_clock(config, rule, model_bytes=4e6)


def time_rule(rule, workers: int, iterations: int, block: int = 1000) -> float:
  """Seconds of host time to simulate `iterations` iterations of `rule`."""
  clock = _clock(rule, workers)
  begin = time.perf_counter()
  done = 0
  while done < iterations:
    done += len(clock.next_block(min(block, iterations - done)).duration)
  return time.perf_counter() - begin


def digits_step_seconds() -> float:
  """Median seconds of one jitted sync training step of the digits MLP (8 workers x batch 16) on this host."""
  config = digits.get_config('sync')
  model = model_registry.make_model(config.model, 10)
  p, b = config.workers, config.batch_size
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((p, b, 64)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, (p, b)), jnp.int32)
  params = model.init(jax.random.key(0), images[0], train=False)['params']
  tx = optax.sgd(config.optimizer.learning_rate, momentum=config.optimizer.momentum)

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({'params': params}, x), y).mean()

  @jax.jit
  def step(state, x, y):
    params, opt_state = state
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x, y)  # one gradient per worker
    grads = jax.tree.map(lambda g: g.mean(axis=0), grads)                  # the all-reduce
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  return measure.time_callable(step, (params, tx.init(params)), images, labels, warmup=3, repeats=50, carry=True)


def main(argv):
  cli.no_positionals(argv)
  p, n = _WORKERS.value, _ITERATIONS.value
  step = digits_step_seconds()
  print(f'jitted digits MLP train step (8 workers x 16, {jax.default_backend()}): {1e6 * step:.1f} us')
  print()
  target = 2.0 * n / 100_000
  print(f'{"rule (P=" + str(p) + ")":<40} {"seconds":>8} {"us/iteration":>12} {"< " + format(target, "g") + " s":>7} '
        f'{"share of a digits step":>24} {"CPU seconds":>12}')
  table = [
      ('KAsync(K=8)', kasync.KAsync(8), None),
      ('Barrier (sync)', sync.Barrier(), None),
      ('PeriodicAverage (local_sgd, H=4)', local_sgd.PeriodicAverage(lambda t: (t + 1) % 4 == 0), None),
      ('RingGossip (dpsgd)', dpsgd.RingGossip(), None),
      ('NonBlocking (m=4)', nonblocking.NonBlocking(4), None),
      ('KSync(K=8)', ksync.KSync(8), None),
      ('KBatchSync(K=8)', kbatch_sync.KBatchSync(8), None),
      ('KBatchAsync(K=8)', kbatch_async.KBatchAsync(8), None),
      ('KBatchAsync(K=1) (async)', kbatch_async.KBatchAsync(1), None),
      ('KBatchAsync(K=1, R=P) (ringmaster)', kbatch_async.KBatchAsync(1, max_delay=_WORKERS.value), None),
      ('AdaSync(KAsync, K0=8)', adasync.AdaSync(kasync.KAsync(8), k0=8, period_s=1.0), None),
      ('DelayedAverage (dasgd, tau=4, d=1)', dasgd.DelayedAverage(4, 1), None),
      ('NodeThreads (lap_sgd, Q=4, H=16)', lap_sgd.NodeThreads(4, lambda t: (t + 1) % 16 == 0), None),
      ('WaitAvoidingGroups (wagma, S=8)', wagma.WaitAvoidingGroups(8, 10), None),
  ]
  chosen = [r.strip().lower() for r in _RULES.value]
  for name, rule, _ in table:
    if chosen and not any(c in name.lower() for c in chosen):
      continue
    cpu = time.process_time()
    seconds = time_rule(rule, p, n)
    cpu = time.process_time() - cpu  # this process's CPU time: what wall time is on a machine shared with others
    per_iteration = seconds / n
    print(f'{name:<40} {seconds:>8.2f} {1e6 * per_iteration:>12.1f} {"yes" if seconds < target else "NO":>7} '
          f'{per_iteration / step:>23.1%} {cpu:>12.2f}', flush=True)


if __name__ == '__main__':
  _ITERATIONS = flags.DEFINE_integer('iterations', 100_000, 'Iterations to time per rule (target: < 2 s per 100,000).')
  _WORKERS = flags.DEFINE_integer('workers', 64, 'Simulated workers.')
  _RULES = flags.DEFINE_list('rules', [], 'Only the rules whose table name contains one of these (default: all).')
  cli.run(main)
