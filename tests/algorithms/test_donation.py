"""Every registered algorithm survives an eager `init` followed by a jitted step that donates params and state.

A user's loop (README, "Using an algorithm in your own training step") runs `tx.init` eagerly, then a step with
`donate_argnums` on params and state. An init that hands the caller's own arrays back inside the state (DiLoCo's
outer model and WAGMA's send buffer did) makes XLA donate one buffer twice: an INVALID_ARGUMENT error, or a
segfault. `spec.owns_its_buffers` copies such leaves; this runs every algorithm that way, with one worker and with
4 vmapped workers, on a two-leaf tree and on a single flat vector (which a one-fragment Streaming DiLoCo gathers
into its outer model unchanged), and checks that the donated step computes what the undonated one does.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.cluster import registry
from waitless.algorithms import spec
from waitless.cluster import schedules
from waitless.experiments.configs import synthetic
from tests.algorithms import test_library

WORKERS = 4
STEPS = 2


def _trees():
  return {'tree': test_library.quadratic_params('float32'), 'vector': jnp.asarray([1.0, -2.0, 0.5, 0.25])}


CASES = [(f'{name}_{tree}_{workers}', name, tree, workers)
         for name in registry.names() for tree in ('tree', 'vector') for workers in (1, WORKERS)]


class DonationTest(parameterized.TestCase):

  def _step_fn(self, name, workers):
    """(tx, step(params, state, t)) for `workers` vmapped workers, or one worker without an axis."""
    config = synthetic.get_config(name)
    config.workers = workers
    axis = test_library.AXIS if workers > 1 else None
    tx = registry.get(name).build(config, optax.sgd(0.05, momentum=0.9), axis)
    schedule = test_library.neutral_schedule(config, workers=workers)
    per_worker, uniform = schedules.split(schedule)
    scales = jnp.linspace(-1.0, 1.0, workers, dtype=jnp.float32)

    def worker(params, state, scale, fields, t):
      sched = type(schedule)(**fields, **uniform)
      updates, state = tx.update(test_library.quadratic_grads(params, scale), state, params, schedule=sched, step=t)
      return optax.apply_updates(params, updates), state

    if workers == 1:
      fields = {k: v[0] for k, v in per_worker.items()}
      return tx, lambda params, state, t: worker(params, state, scales[0], fields, t)
    return tx, lambda params, state, t: jax.vmap(worker, in_axes=(0, 0, 0, 0, None), axis_name=test_library.AXIS)(
        params, state, scales, per_worker, t)

  @parameterized.named_parameters(*CASES)
  def test_eager_init_then_donated_step(self, name, tree, workers):
    tx, step = self._step_fn(name, workers)
    init = tx.init if workers == 1 else jax.vmap(tx.init)

    def fresh():
      params = _trees()[tree]
      if workers > 1:
        params = jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + x.shape) + 0, params)
      return params, init(params)

    params, state = fresh()
    ids = {id(x) for x in jax.tree.leaves(params)}
    self.assertFalse([x for x in jax.tree.leaves(state) if id(x) in ids], 'the state holds a params array')
    donated = jax.jit(step, donate_argnums=(0, 1))
    kept = jax.jit(step)
    want_params, want_state = fresh()
    for t in range(STEPS):
      params, state = donated(params, state, jnp.int32(t))
      want_params, want_state = kept(want_params, want_state, jnp.int32(t))
    for got, want in zip(jax.tree.leaves((params, state)), jax.tree.leaves((want_params, want_state))):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_the_helper_copies_aliases_and_repeats_only(self):
    params = {'a': jnp.ones(3), 'b': jnp.zeros(2)}
    other = jnp.arange(2.0)
    init = spec.owns_its_buffers(lambda p: {'kept': p['a'], 'again': other, 'own': other, 'count': 0})
    state = init(params)
    self.assertIsNot(state['kept'], params['a'])
    np.testing.assert_array_equal(state['kept'], params['a'])
    self.assertEqual(sum(x is other for x in (state['again'], state['own'])), 1)  # the first use is kept
    np.testing.assert_array_equal(state['again'], state['own'])
    self.assertEqual(state['count'], 0)  # not an array: left as it is


if __name__ == '__main__':
  absltest.main()
