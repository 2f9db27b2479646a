"""How fast the cluster simulator is, and what share of a training step it costs.

  python -m benchmarks.simulator_speed                    # 100,000 K-async iterations, 64 workers
  python benchmarks/simulator_speed.py --iterations=20000

Prints (1) the wall time of 100,000 K-async iterations (K = 8 of 64 workers, exponential compute times,
alpha-beta network), (2) the per-iteration host cost of every rule family at 64 workers, and (3) each of them
as a share of one jitted training step of the digits MLP (8 workers x batch 16, per-worker gradients, mean,
SGD with momentum) measured in the same run: the simulator's overhead on a small real step.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from algorithms import adasync
from algorithms import dpsgd
from algorithms import kasync
from algorithms import kbatch_async
from algorithms import kbatch_sync
from algorithms import ksync
from algorithms import local_sgd
from algorithms import nonblocking
from algorithms import sync
from algorithms import wagma
from cluster import calibration
from cluster import factory
from cluster import rules
from experiments.configs import digits
from models import registry as model_registry



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

  return calibration.time_callable(step, (params, tx.init(params)), images, labels, warmup=3, repeats=50,
                                   carry=True)


def main(argv):
  del argv
  p, k, n = _WORKERS.value, _K.value, _ITERATIONS.value
  seconds = time_rule(kasync.KAsync(k), p, n)
  step = digits_step_seconds()
  print(f'K-async (K={k}, P={p}): {n:,} iterations in {seconds:.2f} s = {1e6 * seconds / n:.1f} us/iteration')
  print(f'jitted digits MLP train step (8 workers x 16, {jax.default_backend()}): {1e6 * step:.1f} us')
  print()
  print(f'{"rule (P=" + str(p) + ")":<40} {"us/iteration":>12} {"share of a digits step":>24}')
  table = [
      ('KAsync(K=8)  [timed above]', None, seconds / n),
      ('Barrier (sync)', sync.Barrier(), None),
      ('PeriodicAverage (local_sgd, H=4)', local_sgd.PeriodicAverage(lambda t: (t + 1) % 4 == 0), None),
      ('RingGossip (dpsgd)', dpsgd.RingGossip(), None),
      ('NonBlocking (m=4)', nonblocking.NonBlocking(4), None),
      ('KSync(K=8)', ksync.KSync(8), None),
      ('KBatchSync(K=8)', kbatch_sync.KBatchSync(8), None),
      ('KBatchAsync(K=8)', kbatch_async.KBatchAsync(8), None),
      ('KBatchAsync(K=1) (async)', kbatch_async.KBatchAsync(1), None),
      ('AdaSync(KAsync, K0=8)', adasync.AdaSync(kasync.KAsync(8), k0=8, period_s=1.0), None),
      ('DelayedAverage (dasgd, tau=4, d=1)', rules.DelayedAverage(4, 1), None),
      ('NodeThreads (lap_sgd, Q=4, H=16)', rules.NodeThreads(4, lambda t: (t + 1) % 16 == 0), None),
      ('WaitAvoidingGroups (wagma, S=8)', wagma.WaitAvoidingGroups(8, 10), None),
  ]
  for name, rule, per_iteration in table:
    if per_iteration is None:
      per_iteration = time_rule(rule, p, _OTHERS.value) / _OTHERS.value
    print(f'{name:<40} {1e6 * per_iteration:>12.1f} {per_iteration / step:>23.1%}')


if __name__ == '__main__':
  _ITERATIONS = flags.DEFINE_integer('iterations', 100_000, 'K-async iterations to time.')
  _WORKERS = flags.DEFINE_integer('workers', 64, 'Simulated workers.')
  _K = flags.DEFINE_integer('k', 8, 'K of K-async.')
  _OTHERS = flags.DEFINE_integer('other_iterations', 5_000, 'Iterations per rule in the side-by-side table.')
  app.run(main)
