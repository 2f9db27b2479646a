"""Non-blocking SGD with host-measured speeds: the count rule on hand-made speed tables, the fit of t = c + n s
from measured calls (against numpy's least squares and against the old seconds / n estimate), the moving
average, the per-device while loop (its trips and its compiled form), and the update against a sequential
float64 reference.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from waitless import config_errors as errors
from waitless.experiments.harness import measured_speeds
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


class OverheadCountRuleTest(parameterized.TestCase):
  """n_d = clip(floor((min_f (c_f + m s_f) - c_d) / s_d), 1, m), on binary-exact tables."""

  @parameterized.named_parameters(
      # same c: the overhead changes nothing
      ('same_overhead', [0.25, 0.25], [0.125, 0.25], 4, [4, 2]),
      # same s, c larger by 2 s: it cannot finish m by the fastest's time, 2 fewer
      ('larger_overhead', [0.125, 0.625], [0.25, 0.25], 4, [4, 2]),
      # the fastest by c + m s, not by s: device 1 has the smaller s but the larger total
      ('fastest_by_total', [0.0, 2.0], [0.5, 0.25], 4, [4, 1]),
  )
  def test_counts(self, overhead, seconds, m, expected):
    np.testing.assert_array_equal(measured_speeds.microbatch_counts(seconds, m, overhead_s=overhead), expected)

  def test_zero_overhead_is_the_old_rule(self):
    seconds = [0.01, 0.02, 0.03, 0.05]
    np.testing.assert_array_equal(measured_speeds.microbatch_counts(seconds, 4, overhead_s=[0.0] * 4),
                                  measured_speeds.microbatch_counts(seconds, 4))

  def test_fastest_gets_every_microbatch_whatever_rounding(self):
    rng = np.random.default_rng(1)
    for _ in range(200):
      seconds, overhead = rng.uniform(1e-4, 1.0, size=5), rng.uniform(0.0, 1.0, size=5)
      counts = measured_speeds.microbatch_counts(seconds, 7, overhead_s=overhead)
      totals = overhead + 7 * seconds
      self.assertEqual(counts[np.argmin(totals)], 7)
      # nobody above 1 is given more than it finishes by the fastest's time
      self.assertTrue(np.all((counts == 1) | (overhead + counts * seconds <= totals.min() * (1 + 1e-12))))

  @parameterized.named_parameters(
      ('negative', [0.0, -0.01]), ('nan', [0.0, np.nan]), ('wrong_length', [0.0]), ('table', [[0.0, 0.0]]))
  def test_bad_overhead(self, overhead):
    with self.assertRaisesRegex(errors.ConfigError, '^overhead_s=') as e:
      measured_speeds.microbatch_counts([0.01, 0.02], 4, overhead_s=overhead)
    self.assertNotIn('\n', str(e.exception))


def _calls(overhead, seconds, counts, noise=None):
  """Seconds of one call per device on counts[d] micro-batches: c_d + n_d s_d (times 1 + noise_d)."""
  t = np.asarray(overhead) + np.asarray(counts) * np.asarray(seconds)
  return t if noise is None else t * (1 + noise)


class OverheadFitTest(parameterized.TestCase):
  """`MeasuredSpeeds.observe_calls`: c_d and s_d from (n, seconds) calls, in float64."""

  def _run(self, speeds, overhead, seconds, iterations, rng=None, relative_noise=0.0):
    """Closed loop: each iteration every device runs the counts the estimate gives; returns them."""
    history = []
    for _ in range(iterations):
      counts = speeds.counts()
      noise = None if rng is None else rng.normal(scale=relative_noise, size=len(counts))
      speeds.observe_calls(counts, _calls(overhead, seconds, counts, noise))
      history.append(counts)
    return np.array(history)

  def test_fit_recovers_overhead_and_seconds(self):
    overhead, seconds = [0.003, 0.0007, 0.012], [0.0011, 0.0042, 0.0009]
    speeds = measured_speeds.MeasuredSpeeds(3, 6, probe=(6, 1))
    history = self._run(speeds, overhead, seconds, 5)
    np.testing.assert_array_equal(history[:2], [[6, 6, 6], [1, 1, 1]])  # the warm-up probes both sizes
    np.testing.assert_allclose(speeds.overhead, overhead, rtol=1e-12)
    np.testing.assert_allclose(speeds.seconds, seconds, rtol=1e-12)
    self.assertFalse(any(fit.clamped for fit in speeds.fits))
    # and the counts follow: c + 6 s = 9.6, 25.9, 17.4 ms, so the deadline is device 0's 9.6 ms:
    # floor((9.6 - 0.7) / 4.2) = 2 for device 1, and device 2's 12 ms overhead alone is past it: 1
    np.testing.assert_array_equal(history[2:], [[6, 2, 1]] * 3)

  def test_window_fit_is_the_least_squares_line_of_the_last_calls(self):
    rng = np.random.default_rng(3)
    speeds = measured_speeds.MeasuredSpeeds(1, 8, window=5)
    calls = [(int(n), 0.004 + n * 0.001 + rng.uniform(0, 5e-4)) for n in rng.integers(1, 9, size=12)]
    for n, t in calls:
      speeds.observe_calls([n], [t])
    n, t = np.array(calls[-5:]).T
    self.assertGreater(len(np.unique(n)), 1)
    slope, intercept = np.polyfit(n, t, 1)
    np.testing.assert_allclose([speeds.overhead[0], speeds.seconds[0]], [intercept, slope], rtol=1e-10)

  def test_a_large_overhead_does_not_lock_a_device_the_old_estimate_cuts(self):
    """Both devices take c + n s with the same c >> s; device 1 was cut once (to 1)."""
    c, s, m = 0.006, 0.0013, 4
    # the old estimate, seconds / n: the cut device measures c + s per micro-batch against the other's
    # (c + m s) / m, so it is cut to 1 and, measured at 1, stays there
    old = measured_speeds.MeasuredSpeeds(2, m)
    counts = np.array([m, 1])
    for _ in range(10):
      old.observe(_calls([c, c], [s, s], counts) / counts)
      counts = old.counts()
    np.testing.assert_array_equal(counts, [m, 1])
    # the fit: after the same cut call the line through both sizes is exact, and nobody is cut
    new = measured_speeds.MeasuredSpeeds(2, m)
    new.observe_calls([m, m], _calls([c, c], [s, s], [m, m]))
    new.observe_calls([m, 1], _calls([c, c], [s, s], [m, 1]))
    history = self._run(new, [c, c], [s, s], 10)
    np.testing.assert_array_equal(history, np.full((10, 2), m))
    # device 1's line is exact; device 0 only ever ran m, so its c is not resolved (0) and s = t / m: its
    # deadline c + m s is right either way
    np.testing.assert_allclose(new.overhead, [0.0, c], rtol=1e-12)
    np.testing.assert_allclose(new.overhead + m * new.seconds, [c + m * s] * 2, rtol=1e-12)

  def test_twice_as_slow_per_microbatch_gets_half(self):
    overhead, seconds, m = [0.004, 0.004], [0.001, 0.002], 8
    exact = measured_speeds.MeasuredSpeeds(2, m, probe=(m, 1), tolerance=0.0)
    np.testing.assert_array_equal(self._run(exact, overhead, seconds, 6)[-1], [8, 4])
    # with 3% noise on every call: about half, every iteration
    noisy = measured_speeds.MeasuredSpeeds(2, m, probe=(m, 1), tolerance=0.0)
    history = self._run(noisy, overhead, seconds, 40, np.random.default_rng(0), 0.03)[2:]
    self.assertTrue(np.all(history[:, 0] >= m - 1), history[:, 0])
    self.assertTrue(np.all(np.abs(history[:, 1] - m / 2) <= 1), history[:, 1])
    # the floor takes 4 down to 3 whenever the noise puts the estimate just below it: between 3 and 4 on average
    self.assertBetween(history[:, 1].mean(), m / 2 - 1, m / 2)

  def test_one_size_is_the_old_moving_average(self):
    """Without a probe and at one count only, c = 0 and s_d the moving average of seconds / n."""
    calls, old = measured_speeds.MeasuredSpeeds(2, 4), measured_speeds.MeasuredSpeeds(2, 4)
    for t in ([0.02, 0.03], [0.04, 0.01], [0.02, 0.02]):
      calls.observe_calls([4, 4], t)
      old.observe(np.array(t) / 4)
    np.testing.assert_allclose(calls.seconds, old.seconds, rtol=1e-15)
    np.testing.assert_array_equal(calls.overhead, [0.0, 0.0])
    self.assertEqual(calls.fits, [None, None])
    np.testing.assert_array_equal(calls.counts(), old.counts())

  def test_window_of_one_size_keeps_the_last_overhead(self):
    c, s, slower = 0.01, 0.002, 0.005
    speeds = measured_speeds.MeasuredSpeeds(1, 4, window=3)
    for n in (4, 1, 2, 2, 2):  # the window now holds 2, 2, 2: the last fit was through 1, 2, 2, exact
      speeds.observe_calls([n], [c + n * s])
    fit = speeds.fits[0]
    np.testing.assert_allclose([speeds.overhead[0], speeds.seconds[0]], [c, s], rtol=1e-12)
    speeds.observe_calls([2], [c + 2 * slower])  # the device slowed down: c kept, s moves halfway
    self.assertIs(speeds.fits[0], fit)
    np.testing.assert_allclose([speeds.overhead[0], speeds.seconds[0]], [c, 0.5 * s + 0.5 * slower], rtol=1e-12)
    speeds.observe_calls([2], [0.5 * c])  # a call shorter than c: c cannot be that large, it is dropped
    self.assertEqual(speeds.overhead[0], 0.0)
    np.testing.assert_allclose(speeds.seconds[0], 0.5 * (0.5 * s + 0.5 * slower) + 0.5 * (0.25 * c), rtol=1e-12)

  def test_times_that_do_not_grow_with_n_fall_back(self):
    speeds = measured_speeds.MeasuredSpeeds(1, 4)
    speeds.observe_calls([4], [0.01])
    speeds.observe_calls([1], [0.02])  # fit_overhead refuses a slope <= 0: the moving average of t / n
    self.assertIsNone(speeds.fits[0])
    np.testing.assert_allclose(speeds.seconds, [0.5 * 0.0025 + 0.5 * 0.02], rtol=1e-15)

  def test_probe_counts(self):
    speeds = measured_speeds.MeasuredSpeeds(2, 5, probe=(5, 1, 3), tolerance=0.0)
    for expected in (5, 1, 3):
      np.testing.assert_array_equal(speeds.counts(), [expected, expected])
      speeds.observe_calls(speeds.counts(), _calls([0.01, 0.01], [0.002, 0.004], speeds.counts()))
    np.testing.assert_array_equal(speeds.counts(), [5, 2])  # floor((0.02 - 0.01) / 0.004) = 2

  def test_tolerance_keeps_equally_fast_devices_at_m_through_noise(self):
    """Two equally fast devices, 5% noise on every call: without a tolerance the floor gives the
    slower-looking one m - 1 (one device of the two on about every iteration); 0.1 of the deadline keeps both
    at m nearly always."""
    overhead, seconds, m = [0.002, 0.002], [0.001, 0.001], 4
    history = {}
    for tolerance in (0.0, 0.1):
      speeds = measured_speeds.MeasuredSpeeds(2, m, probe=(m, 1), tolerance=tolerance, min_slack_s=0.0)
      history[tolerance] = self._run(speeds, overhead, seconds, 200, np.random.default_rng(1), 0.05)[2:]
    self.assertLess(history[0.0].mean(), m - 0.3)
    self.assertGreater(history[0.1].mean(), m - 0.05)
    self.assertGreater(history[0.1].mean(), history[0.0].mean())

  def test_tolerance_still_cuts_a_slow_device(self):
    """A device 1.5x slower per micro-batch is past (1 + 0.1) of the deadline on all m: it is cut."""
    speeds = measured_speeds.MeasuredSpeeds(2, 8, probe=(8, 1))
    counts = self._run(speeds, [0.0, 0.0], [0.001, 0.0015], 4)[-1]
    # the slack is max(0.1 x 8 ms, 1 ms) = 1 ms: floor(9 ms / 1.5 ms) = 6
    np.testing.assert_array_equal(counts, [8, 6])

  def test_min_slack_keeps_sub_millisecond_devices_at_m_through_noise(self):
    """Calls of a fraction of a millisecond (0.05 ms per micro-batch) with 30% noise: 10% of the deadline
    is microseconds and keeps cutting; the 1 ms floor keeps both at m. A device twice as slow per
    micro-batch is still cut once its all-m time exceeds the deadline by more than 1 ms."""
    overhead, seconds, m = [0.0001, 0.0001], [0.00005, 0.00005], 4
    history = {}
    for slack in (0.0, 0.001):
      speeds = measured_speeds.MeasuredSpeeds(2, m, probe=(m, 1), min_slack_s=slack)
      history[slack] = self._run(speeds, overhead, seconds, 200, np.random.default_rng(2), 0.3)[2:]
    self.assertLess(history[0.0].mean(), m - 0.3)
    np.testing.assert_array_equal(history[0.001], np.full_like(history[0.001], m))
    slow = measured_speeds.MeasuredSpeeds(2, 8, probe=(8, 1))
    # deadline 0.1 + 8 x 0.5 = 4.1 ms, + 1 ms: floor((5.1 - 0.1) / 1) = 5
    np.testing.assert_array_equal(self._run(slow, [0.0001] * 2, [0.0005, 0.001], 4)[-1], [8, 5])

  def test_counts_with_tolerance(self):
    # deadline 1.1 * 8 ms = 8.8 ms: floor(8.8 / 1.2) = 7, floor((8.8 - 2) / 2) = 3
    np.testing.assert_array_equal(
        measured_speeds.microbatch_counts([0.001, 0.0012, 0.002], 8, overhead_s=[0.0, 0.0, 0.002], tolerance=0.1),
        [8, 7, 3])
    # the larger of the two slacks: 8 ms + 2 ms: floor(10 / 1.2) = 8, floor((10 - 2) / 2) = 4
    np.testing.assert_array_equal(
        measured_speeds.microbatch_counts([0.001, 0.0012, 0.002], 8, overhead_s=[0.0, 0.0, 0.002], tolerance=0.1,
                                          min_slack_s=0.002), [8, 8, 4])

  @parameterized.named_parameters(
      ('window', {'window': 1}, '^window=1 .*>= 2'),
      ('tolerance_negative', {'tolerance': -0.1}, '^tolerance=-0.1 .*>= 0'),
      ('tolerance_nan', {'tolerance': float('nan')}, '^tolerance=nan .*>= 0'),
      ('min_slack_negative', {'min_slack_s': -1.0}, '^min_slack_s=-1.0 .*seconds >= 0'),
      ('probe_zero', {'probe': (4, 0)}, '^probe=.*in 1..4'),
      ('probe_above_m', {'probe': (5,)}, '^probe=.*in 1..4'),
      ('probe_float', {'probe': (1.0,)}, '^probe='),
  )
  def test_bad_settings(self, overrides, message):
    with self.assertRaisesRegex(errors.ConfigError, message) as e:
      measured_speeds.MeasuredSpeeds(2, 4, **overrides)
    self.assertNotIn('\n', str(e.exception))

  @parameterized.named_parameters(
      ('wrong_length', [4], [0.01, 0.01], '^counts=.*one micro-batch count in 1..4 per device'),
      ('zero', [4, 0], [0.01, 0.01], '^counts='),
      ('above_m', [4, 5], [0.01, 0.01], '^counts='),
      ('float', [4.0, 4.0], [0.01, 0.01], '^counts='),
      ('negative_time', [4, 4], [0.01, -0.01], '^call_seconds=.*> 0'),
      ('short_times', [4, 4], [0.01], '^call_seconds=.*needs one per device'),
  )
  def test_bad_calls(self, counts, seconds, message):
    with self.assertRaisesRegex(errors.ConfigError, message) as e:
      measured_speeds.MeasuredSpeeds(2, 4).observe_calls(counts, seconds)
    self.assertNotIn('\n', str(e.exception))


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
    warmup = []
    for _ in range(3):
      params, opt_state, _ = step(params, opt_state, batch)
      warmup.append(step.last_counts.tolist())
    # compile (not measured), then the two measured sizes the fit needs
    self.assertEqual(warmup, [[M] * D, [M] * D, [1] * D])
    self.assertEqual([n for n, _ in step.speeds.calls[0]], [M, 1])
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
