"""Non-blocking SGD with host-measured speeds: the count rule on hand-made speed tables, the moving average, the
per-device while loop (its trips and its compiled form), and the update against a sequential float64 reference.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from waitless import config_errors as errors
from waitless.algorithms import measured_speeds
from tests import hlo
from tests.algorithms import reference

D, M, B, FEATURES = 4, 5, 3, 3  # devices, micro-batches per batch, samples per micro-batch, features


def _loss(params, mb):
  x, y = mb
  return 0.5 * jnp.mean((x @ params['w'] + params['b'] - y) ** 2)


def _problem(seed, dtype):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(D, M, B, FEATURES)).astype(dtype)
  y = rng.normal(size=(D, M, B)).astype(dtype)
  return x, y


class CountRuleTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('equal', [0.01, 0.01, 0.01], 4, None, [4, 4, 4]),
      # m s_min / s_d = 4, 2, 1.33, 0.8 -> floor, at least 1
      ('spread', [0.01, 0.02, 0.03, 0.05], 4, None, [4, 2, 1, 1]),
      ('fastest_not_first', [0.3, 0.1, 0.2], 6, None, [2, 6, 3]),
      ('one_microbatch', [0.01, 5.0], 1, None, [1, 1]),
      # an explicit budget: floor(0.1 / s_d), clipped to 1..m
      ('deadline', [0.01, 0.03, 0.5], 8, 0.1, [8, 3, 1]),
      ('deadline_short', [0.02, 0.04], 3, 0.05, [2, 1]),
  )
  def test_counts(self, seconds, m, deadline, expected):
    counts = measured_speeds.microbatch_counts(seconds, m, deadline)
    np.testing.assert_array_equal(counts, expected)
    self.assertEqual(counts.dtype, np.int32)

  def test_fastest_gets_every_microbatch_whatever_rounding(self):
    rng = np.random.default_rng(0)
    for _ in range(200):
      seconds = rng.uniform(1e-4, 1.0, size=5)
      counts = measured_speeds.microbatch_counts(seconds, 7)
      self.assertEqual(counts[np.argmin(seconds)], 7)
      # no device is given more than it can finish by the deadline (the first finisher's time)
      self.assertTrue(np.all(counts * seconds <= 7 * seconds.min() * (1 + 1e-12) + (counts == 1) * seconds))

  @parameterized.named_parameters(
      ('negative', [0.01, -0.02], 'seconds_per_microbatch'),
      ('zero', [0.01, 0.0], 'seconds_per_microbatch'),
      ('nan', [np.nan, 0.01], 'seconds_per_microbatch'),
      ('inf', [np.inf, 0.01], 'seconds_per_microbatch'),
      ('empty', [], 'seconds_per_microbatch'),
      ('table', [[0.01, 0.02]], 'seconds_per_microbatch'),
  )
  def test_bad_speed_table(self, seconds, field):
    with self.assertRaisesRegex(errors.ConfigError, f'^{field}=') as e:
      measured_speeds.microbatch_counts(seconds, 4)
    self.assertNotIn('\n', str(e.exception))

  @parameterized.named_parameters(('zero', 0.0), ('negative', -1.0), ('nan', float('nan')), ('inf', float('inf')))
  def test_bad_deadline(self, deadline):
    with self.assertRaisesRegex(errors.ConfigError, '^deadline_s=.*seconds > 0$'):
      measured_speeds.microbatch_counts([0.01], 4, deadline)
    with self.assertRaisesRegex(errors.ConfigError, '^deadline_s='):
      measured_speeds.MeasuredSpeeds(2, 4, deadline_s=deadline)

  def test_bad_microbatches(self):
    with self.assertRaisesRegex(errors.ConfigError, '^microbatches=0 .*>= 1'):
      measured_speeds.microbatch_counts([0.01], 0)


class MeasuredSpeedsTest(parameterized.TestCase):

  def test_moving_average(self):
    speeds = measured_speeds.MeasuredSpeeds(devices=2, microbatches=4, smoothing=0.5)
    np.testing.assert_array_equal(speeds.counts(), [4, 4])  # nothing measured yet: a synchronous round
    speeds.observe([0.01, 0.04])
    np.testing.assert_allclose(speeds.seconds, [0.01, 0.04])
    np.testing.assert_array_equal(speeds.counts(), [4, 1])
    speeds.observe([0.03, 0.02])  # s <- 0.5 s + 0.5 observed = [0.02, 0.03]
    np.testing.assert_allclose(speeds.seconds, [0.02, 0.03])
    np.testing.assert_array_equal(speeds.counts(), [4, 2])

  def test_initial_seconds_and_deadline(self):
    speeds = measured_speeds.MeasuredSpeeds(3, 6, initial_seconds=[0.01, 0.02, 0.04], deadline_s=0.05)
    np.testing.assert_array_equal(speeds.counts(), [5, 2, 1])

  @parameterized.named_parameters(
      ('wrong_length', {'initial_seconds': [0.01, 0.02]}, '^initial_seconds=.*needs one per device'),
      ('zero', {'initial_seconds': [0.01, 0.0, 0.1]}, '^initial_seconds=.*> 0'),
      ('smoothing_one', {'smoothing': 1.0}, '^smoothing=1.0 .*in \\[0, 1\\)'),
      ('smoothing_negative', {'smoothing': -0.1}, '^smoothing='),
      ('devices', {'devices': 0}, '^devices=0 '),
  )
  def test_bad_settings(self, overrides, message):
    kwargs = {'devices': 3, 'microbatches': 4, **overrides}
    with self.assertRaisesRegex(errors.ConfigError, message) as e:
      measured_speeds.MeasuredSpeeds(**kwargs)
    self.assertNotIn('\n', str(e.exception))

  def test_bad_observation(self):
    speeds = measured_speeds.MeasuredSpeeds(2, 4)
    with self.assertRaisesRegex(errors.ConfigError, '^seconds_per_microbatch=.*needs one per device'):
      speeds.observe([0.01])
    with self.assertRaisesRegex(errors.ConfigError, '^seconds_per_microbatch=.*> 0'):
      speeds.observe([0.01, np.nan])


class WhileLoopTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = Mesh(np.array(jax.devices()[:D]), ('workers',))
    self.spec = PartitionSpec('workers')

  def _gradients(self):
    step = measured_speeds.MeasuredStep(_loss, optax.sgd(0.1), self.mesh, M)
    return step.gradients

  def test_runs_exactly_the_counted_microbatches(self):
    with jax.enable_x64(True):
      x, y = _problem(0, np.float64)
      params = {'w': np.random.default_rng(1).normal(size=(D, FEATURES)), 'b': np.full((D,), 0.3)}
      counts = np.array([5, 1, 3, 2], np.int32)
      grads, losses, trips = self._gradients()(params, (x, y), counts)
      np.testing.assert_array_equal(np.asarray(trips), counts)
      for d in range(D):
        w, b = params['w'][d], params['b'][d]
        sums = [sum(parts) for parts in zip(*[reference.gradient(w, b, x[d, k], y[d, k]) for k in range(counts[d])])]
        np.testing.assert_allclose(np.asarray(grads['w'][d]), sums[0], rtol=1e-12)
        np.testing.assert_allclose(np.asarray(grads['b'][d]), sums[1], rtol=1e-12)
        loss = sum(0.5 * np.mean((x[d, k] @ w + b - y[d, k]) ** 2) for k in range(counts[d]))
        np.testing.assert_allclose(float(losses[d]), loss, rtol=1e-6)  # the loss sum is float32

  def test_compiled_loop_has_a_data_dependent_trip_count_and_no_collective(self):
    x, y = _problem(0, np.float32)
    params = {'w': np.zeros((D, FEATURES), np.float32), 'b': np.zeros((D,), np.float32)}
    text = self._gradients().lower(params, (x, y), np.full(D, M, np.int32)).compile().as_text()
    module = hlo.parse(text)
    self.assertIn('while', [op for ops in module.ops.values() for op in ops])
    # A loop over all m micro-batches (a scan, or a while with a constant bound) is annotated with its trip
    # count; the count here is an input, so XLA knows none.
    self.assertNotIn('known_trip_count', text)
    self.assertEqual(module.collectives(module.ops), [])  # nothing waits for another device

  def test_a_constant_bound_would_have_a_known_trip_count(self):
    """The check above can fail: the same loop bounded by the constant m is annotated with its trip count."""
    value_and_grad = jax.value_and_grad(_loss)

    def device(params, microbatches):
      first = jax.tree.map(lambda a: a[0], (params, microbatches))
      bound = jax.lax.pcast(jnp.int32(M), 'workers', to='varying')  # the per-device type of a real count
      return measured_speeds.local_gradient_sums(value_and_grad, *first, bound)[2][None]
    fn = jax.jit(jax.shard_map(device, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec))
    params = {'w': np.zeros((D, FEATURES), np.float32), 'b': np.zeros((D,), np.float32)}
    text = fn.lower(params, _problem(0, np.float32)).compile().as_text()
    self.assertIn('known_trip_count', text)


class MeasuredStepTest(parameterized.TestCase):

  def test_update_is_the_weighted_average(self):
    """Three iterations with hand-set speed tables against momentum SGD on g = sum_d G_d / sum_d n_d, float64."""
    tables = [[0.01, 0.01, 0.01, 0.01], [0.01, 0.02, 0.05, 0.03], [0.04, 0.01, 0.02, 0.015]]
    lr, momentum = 0.1, 0.9
    with jax.enable_x64(True):
      mesh = Mesh(np.array(jax.devices()[:D]), ('workers',))
      per_device = NamedSharding(mesh, PartitionSpec('workers'))
      step = measured_speeds.MeasuredStep(_loss, optax.sgd(lr, momentum), mesh, M)
      w0 = np.random.default_rng(2).normal(size=FEATURES)
      params = jax.device_put({'w': np.tile(w0, (D, 1)), 'b': np.zeros(D)}, per_device)
      opt_state = jax.device_put(jax.vmap(step.tx.init)(params), per_device)
      sgd = reference.MomentumSGD(lr, momentum)
      model = [w0, 0.0]
      for t, table in enumerate(tables):
        x, y = _problem(10 + t, np.float64)
        step.speeds = measured_speeds.MeasuredSpeeds(D, M, initial_seconds=table)
        params, opt_state, loss = step(params, opt_state, jax.device_put((x, y), per_device))
        counts = step.last_counts
        np.testing.assert_array_equal(counts, measured_speeds.microbatch_counts(table, M))
        np.testing.assert_array_equal(np.asarray(step.last_trips), counts)
        parts = [reference.gradient(model[0], model[1], x[d, k], y[d, k]) for d in range(D) for k in range(counts[d])]
        g = [sum(p[i] for p in parts) / counts.sum() for i in range(2)]
        losses = [0.5 * np.mean((x[d, k] @ model[0] + model[1] - y[d, k]) ** 2)
                  for d in range(D) for k in range(counts[d])]
        np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-6)
        model = sgd.step(model, g)
        for d in range(D):  # every device holds the same model
          np.testing.assert_allclose(np.asarray(params['w'][d]), model[0], rtol=1e-12)
          np.testing.assert_allclose(float(params['b'][d]), model[1], rtol=1e-12, atol=1e-15)
      self.assertTrue(np.any(step.last_counts < M))  # the test did exercise partial work

  def test_measures_and_gathers_the_speeds(self):
    mesh = Mesh(np.array(jax.devices()[:D]), ('workers',))
    per_device = NamedSharding(mesh, PartitionSpec('workers'))
    step = measured_speeds.MeasuredStep(_loss, optax.sgd(0.1), mesh, M)
    params = jax.device_put({'w': np.zeros((D, FEATURES), np.float32), 'b': np.zeros(D, np.float32)}, per_device)
    opt_state = jax.device_put(jax.vmap(step.tx.init)(params), per_device)
    batch = jax.device_put(_problem(0, np.float32), per_device)
    for _ in range(3):
      params, opt_state, _ = step(params, opt_state, batch)
    self.assertIsNotNone(step.speeds.seconds)  # observed after the compiling call
    self.assertEqual(step.speeds.seconds.shape, (D,))
    self.assertTrue(np.all(step.speeds.seconds > 0))
    # one process: its devices share its one measurement, so they run the same count (all m)
    np.testing.assert_array_equal(step.speeds.counts(), np.full(D, M))

  def test_refuses_a_mesh_with_local_workers(self):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('workers', 'local'))
    with self.assertRaisesRegex(errors.ConfigError, '^mesh=.*one worker per device'):
      measured_speeds.MeasuredStep(_loss, optax.sgd(0.1), mesh, M)


if __name__ == '__main__':
  absltest.main()
