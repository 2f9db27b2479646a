"""The shared delayed-averaging mechanism on its own: P vmapped workers, any pytree, against numpy."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from waitless.algorithms import delayed_averaging as da

P = 4
AXIS = 'workers'


def _increments(n, seed=0):
  """Per-iteration local progress of each worker: a stand-in for W_i + U_i(g_i)."""
  rng = np.random.default_rng(seed)
  return [{'a': rng.normal(size=(P, 3)), 'b': {'c': rng.normal(size=(P, 2, 2))}} for _ in range(n)]


def _reference(events, increments, correction, mix):
  """numpy replay of the rule: apply the older mean, snapshot, then the blocking mean (age 0)."""
  tree = jax.tree.map(np.zeros_like, increments[0])
  snap = None
  out = []

  def correct(w, s):
    mean = np.mean(s, axis=0, keepdims=True)
    return mean + (w - s) if correction == 'local_progress' else mix * w + (1 - mix) * mean

  for (snapshot, apply_average, age), inc in zip(events, increments):
    tree = jax.tree.map(np.add, tree, inc)
    if apply_average and age > 0:
      tree = jax.tree.map(correct, tree, snap)
    if snapshot:
      snap = tree
    if apply_average and age == 0:
      tree = jax.tree.map(correct, tree, snap)
    out.append(tree)
  return out


def _run(events, increments, correction, mix):
  def one(tree, buffer, inc, snapshot, apply_average, age):
    tree = jax.tree.map(jnp.add, tree, inc)
    return da.step(tree, buffer, snapshot, apply_average, age, axis_name=AXIS, correction=correction, mix=mix)

  fn = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None, None, None), axis_name=AXIS))
  tree = jax.tree.map(jnp.zeros_like, increments[0])
  buffer = jax.vmap(da.init)(tree)
  out = []
  for (snapshot, apply_average, age), inc in zip(events, increments):
    tree, buffer = fn(tree, buffer, inc, jnp.bool_(snapshot), jnp.bool_(apply_average), jnp.int32(age))
    out.append(tree)
  return out


def _fixed_period_events(n, period, delay):
  return [tuple(int(x) for x in da.schedule_at(t, period, delay)) for t in range(n)]


class DelayedAveragingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('tau3_d2', 'local_progress', _fixed_period_events(12, 3, 2)),
      ('tau3_d2_mix', 'mix', _fixed_period_events(12, 3, 2)),
      ('tau2_d0_mix', 'mix', _fixed_period_events(8, 2, 0)),
      # LAP-SGD with H = 2 < d = 3: each snapshot first applies the mean still in flight (age 2).
      ('snapshot_forces_the_pending_apply', 'local_progress',
       [(t % 2 == 1, t in (3, 5, 7), 2 if t in (3, 5, 7) else 0) for t in range(8)]))
  def test_step_matches_numpy(self, correction, events):
    with jax.enable_x64(True):
      increments = _increments(len(events))
      got = _run(events, increments, correction, 0.3)
    want = _reference(events, increments, correction, 0.3)
    self.assertTrue(any(e[1] for e in events))
    for t, (g, w) in enumerate(zip(got, want)):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, err_msg=f'it {t}'), g, w)

  @parameterized.named_parameters(
      ('d1', 3, 1, 'local_progress'), ('d_equals_tau_mix', 3, 3, 'mix'), ('d2_mix', 4, 2, 'mix'),
      ('d0', 3, 0, 'local_progress'), ('tau1', 1, 1, 'mix'))
  def test_round_step_equals_step(self, period, delay, correction):
    rounds = 3
    with jax.enable_x64(True):
      increments = _increments(rounds * period, seed=1)
      want = _run(_fixed_period_events(rounds * period, period, delay), increments, correction, 0.3)

      def one_round(tree, buffer, incs, first):
        outs = []
        for r in range(period):
          tree = jax.tree.map(jnp.add, tree, jax.tree.map(lambda x: x[r], incs))
          tree, buffer = da.round_step(tree, buffer, r, period, delay, in_flight=~first, axis_name=AXIS,
                                       correction=correction, mix=0.3)
          outs.append(tree)
        return tree, buffer, outs

      fn = jax.jit(jax.vmap(one_round, in_axes=(0, 0, 0, None), axis_name=AXIS))
      tree = jax.tree.map(jnp.zeros_like, increments[0])
      buffer = jax.vmap(da.init)(tree)
      got = []
      for k in range(rounds):
        incs = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *increments[k * period:(k + 1) * period])
        tree, buffer, outs = fn(tree, buffer, incs, jnp.bool_(k == 0))
        got += outs
    for t, (g, w) in enumerate(zip(got, want)):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13, err_msg=f'it {t}'), g, w)

  def test_one_worker_needs_no_axis(self):
    tree = {'w': jnp.array([1.0, 2.0])}
    buffer = da.init(tree)
    tree, buffer = da.step(tree, buffer, True, False, 0, axis_name=None)
    moved = {'w': tree['w'] + 1.0}
    new, _ = da.step(moved, buffer, False, True, 1, axis_name=None, correction='mix', mix=0.25)
    np.testing.assert_allclose(new['w'], 0.25 * moved['w'] + 0.75 * tree['w'])

  def test_bad_arguments(self):
    tree = {'w': jnp.zeros(2)}
    with self.assertRaisesRegex(ValueError, 'correction'):
      da.step(tree, tree, True, False, 0, axis_name=None, correction='average')
    with self.assertRaisesRegex(ValueError, 'mix'):
      da.step(tree, tree, True, False, 0, axis_name=None, correction='mix', mix=2.0)
    with self.assertRaisesRegex(ValueError, 'delay'):
      da.round_step(tree, tree, 0, 2, 3, in_flight=True, axis_name=None)


if __name__ == '__main__':
  absltest.main()
