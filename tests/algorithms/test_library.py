"""Every registered algorithm as a plain optax transformation, without the harness (optax's alias_test style).

Each is built with `axis_name=None` (one worker, no collective) and inside a plain `jax.vmap(axis_name=...)`
over 4 workers (no shard_map), its `update` jitted and run for a few steps on a small quadratic in float32 and
bfloat16 with a neutral schedule: the first iteration of its own time rule with constant compute on an ideal
network. Checked: finite updates and state, the params' tree, shapes and dtypes kept, the state's dtypes kept.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.cluster import registry
from waitless.cluster import factory
from waitless.cluster import schedules
from waitless.experiments.configs import synthetic

WORKERS = 4
STEPS = 3
AXIS = 'workers'


def neutral_schedule(config, workers: int):
  """Iteration 0 of the algorithm's time rule, no stragglers, ideal network: per-worker (P,), uniform ()."""
  config.workers = workers
  for field in ('k', 'k0'):  # K-of-P variants: K <= P, so K = 1 for one worker
    if field in config.algorithm:
      config.algorithm[field] = min(config.algorithm[field], workers)
  clock = factory.make_clock(config, registry.time_rule(config), model_bytes=64.0)
  return schedules.take(clock.next_block(1).schedule, 0)


def quadratic_params(dtype):
  return {'w': jnp.asarray([1.0, -2.0, 0.5], dtype), 'b': jnp.asarray(0.25, dtype)}


def quadratic_grads(params, scale):
  # f(W) = 0.5 ||W - scale||^2: the gradient is W - scale (scale differs per worker under vmap).
  return jax.tree.map(lambda p: p - scale.astype(p.dtype), params)


def _dtypes(tree):
  return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


CASES = [(f'{name}_{dtype}', name, dtype) for name in registry.names() for dtype in ('float32', 'bfloat16')]


class LibraryTest(parameterized.TestCase):

  def _build(self, name, axis_name):
    config = synthetic.get_config(name)
    config.workers = WORKERS
    inner = optax.sgd(0.05, momentum=0.9)
    return config, registry.get(name).build(config, inner, axis_name)

  def _check(self, params, updates, state, init_state):
    self.assertEqual(jax.tree.structure(updates), jax.tree.structure(params))
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
      self.assertEqual(u.shape, p.shape)
      self.assertEqual(u.dtype, p.dtype)
      self.assertTrue(np.all(np.isfinite(np.asarray(u, np.float32))))
    self.assertEqual(jax.tree.structure(state), jax.tree.structure(init_state))
    self.assertEqual(jax.tree.leaves(_dtypes(state)), jax.tree.leaves(_dtypes(init_state)))
    for leaf in jax.tree.leaves(state):
      if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
        self.assertTrue(np.all(np.isfinite(np.asarray(leaf, np.float32))))

  @parameterized.named_parameters(*CASES)
  def test_one_worker(self, name, dtype):
    config, tx = self._build(name, axis_name=None)
    schedule = neutral_schedule(config, workers=1)
    per_worker, uniform = schedules.split(schedule)
    schedule = type(schedule)(**{k: v[0] for k, v in per_worker.items()}, **uniform)
    params = quadratic_params(dtype)
    state = init_state = tx.init(params)

    @jax.jit
    def step(params, state, t):
      updates, state = tx.update(quadratic_grads(params, jnp.float32(0.3)), state, params, schedule=schedule, step=t)
      return updates, state

    for t in range(STEPS):
      updates, state = step(params, state, jnp.int32(t))
      self._check(params, updates, state, init_state)
      params = optax.apply_updates(params, updates)

  @parameterized.named_parameters(*CASES)
  def test_vmapped_workers(self, name, dtype):
    config, tx = self._build(name, axis_name=AXIS)
    schedule = neutral_schedule(config, workers=WORKERS)
    per_worker, uniform = schedules.split(schedule)
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (WORKERS,) + x.shape), quadratic_params(dtype))
    state = init_state = jax.vmap(tx.init)(params)
    scales = jnp.linspace(-1.0, 1.0, WORKERS, dtype=jnp.float32)

    @jax.jit
    def step(params, state, t):
      def worker(params, state, scale, fields):
        sched = type(schedule)(**fields, **uniform)
        return tx.update(quadratic_grads(params, scale), state, params, schedule=sched, step=t)
      return jax.vmap(worker, axis_name=AXIS)(params, state, scales, per_worker)

    for t in range(STEPS):
      updates, state = step(params, state, jnp.int32(t))
      self._check(params, updates, state, init_state)
      params = optax.apply_updates(params, updates)


if __name__ == '__main__':
  absltest.main()
