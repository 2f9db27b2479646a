"""The fits of calibration: a call's overhead, a collective's alpha-beta, rounds, the rescaled stragglers."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.cluster import factory
from tests.cluster import helpers


class CalibrationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('constant', {}),
      ('exponential', {'kind': 'exponential', 'rate': 3.0}),
      ('shifted_exponential', {'kind': 'shifted_exponential', 'shift_s': 0.5, 'rate': 2.0}),
      ('pareto', {'kind': 'pareto', 'shape': 3.0, 'scale': 1.0}),
      ('random_delay', {'kind': 'random_delay', 'delayed_workers': 1, 'delay_s': 0.3}),
  )
  def test_calibrated_mean(self, overrides):
    config = helpers.config(workers=4, calibrate=True, **overrides)
    config.stragglers = calibration.calibrated(config.stragglers, 0.02)
    self.assertFalse(config.stragglers.calibrate)
    factory.validate(config)
    model = factory.make_compute(config.stragglers, 4)
    self.assertAlmostEqual(model.mean(), 0.02)
    self.assertEqual(config.stragglers.get('delay_s'), overrides.get('delay_s', 0.0))


  def test_calibrated_keeps_or_sets_the_overhead(self):
    config = helpers.config(workers=4, kind='exponential', rate=3.0, overhead_s=0.005)
    kept = calibration.calibrated(config.stragglers, 0.02)
    self.assertEqual(kept.overhead_s, 0.005)
    self.assertAlmostEqual(1.0 / kept.rate, 0.015)
    fitted = calibration.calibrated(config.stragglers, 0.02, overhead_s=0.0125)
    self.assertEqual(fitted.overhead_s, 0.0125)
    self.assertAlmostEqual(factory.make_compute(fitted, 4).mean(), 0.02)
    with self.assertRaisesRegex(errors.ConfigError, r'stragglers.overhead_s=0.005 .*below the measured 0.004 s'):
      calibration.calibrated(config.stragglers, 0.004)
    with self.assertRaisesRegex(errors.ConfigError, r'stragglers.overhead_s=-1.0 .*>= 0'):
      calibration.calibrated(config.stragglers, 0.02, overhead_s=-1.0)
    with self.assertRaisesRegex(ValueError, 'seconds=0.0 must be > 0'):
      calibration.calibrated(config.stragglers, 0.0)


class FitOverheadTest(parameterized.TestCase):

  def test_two_points_give_the_line_through_them(self):
    fit = calibration.fit_overhead([8, 32], [0.000258, 0.000408])
    self.assertAlmostEqual(fit.per_sample_s, 0.00015 / 24, places=15)
    self.assertAlmostEqual(fit.overhead_s, 0.000258 - 8 * 0.00015 / 24, places=15)
    self.assertFalse(fit.clamped)
    self.assertAlmostEqual(fit.seconds(32), 0.000408, places=15)

  def test_least_squares_over_more_sizes(self):
    # Residuals (+1/6, -1/3, +1/6) x 1e-3 around t = 1/3 ms + s x 1.5 ms: exact in closed form.
    fit = calibration.fit_overhead([1, 2, 3], [2e-3, 3e-3, 5e-3])
    self.assertAlmostEqual(fit.per_sample_s, 1.5e-3, places=15)
    self.assertAlmostEqual(fit.overhead_s, 1e-3 / 3, places=15)
    exact = calibration.fit_overhead([1, 4, 16, 64], [0.2 + 0.01 * s for s in (1, 4, 16, 64)])
    self.assertAlmostEqual(exact.overhead_s, 0.2, places=12)
    self.assertAlmostEqual(exact.per_sample_s, 0.01, places=14)

  def test_a_negative_overhead_is_clamped_and_the_slope_refitted_through_zero(self):
    fit = calibration.fit_overhead([1, 2, 3], [1.0, 2.0, 4.0])  # least squares: -1/3 + 1.5 s
    self.assertTrue(fit.clamped)
    self.assertEqual(fit.overhead_s, 0.0)
    self.assertAlmostEqual(fit.per_sample_s, 17 / 14, places=14)  # sum s t / sum s^2

  @parameterized.named_parameters(
      ('one_size', [16, 16], [1.0, 1.1], 'two or more distinct sizes'),
      ('shapes', [4, 16], [1.0], 'two or more distinct sizes'),
      ('flat', [4, 16], [1.0, 1.0], 'do not grow'),
      ('falling', [4, 16], [1.0, 0.5], 'do not grow'),
  )
  def test_bad_timings(self, samples, seconds, message):
    with self.assertRaisesRegex(ValueError, message):
      calibration.fit_overhead(samples, seconds)


class RoundsTest(absltest.TestCase):

  def test_a_round_another_job_slowed_is_dropped(self):
    value, spread, dropped = calibration.robust([1.0, 1.1, 0.9, 1.05, 5.0])
    self.assertEqual(dropped, [4])
    self.assertAlmostEqual(value, 1.025)  # the median of the four kept rounds
    self.assertAlmostEqual(spread, calibration.MAD_SCALE * 0.05)  # their scaled MAD, not inflated by 5.0
    self.assertEqual(calibration.robust([1.0, 9.0])[2], [])  # two rounds: nothing to tell the outlier by
    self.assertEqual(calibration.robust([2.0, 2.0, 2.0, 7.0])[2], [])  # MAD 0: nothing dropped
    figure = calibration.figure([1.0, 1.1, 0.9, 1.05, 5.0], 'test', loads=[1, 2, 3, 4, 12.5])
    self.assertEqual((figure['dropped'], figure['load'], figure['rounds'][-1]), ([4], [1, 2, 3, 4, 12.5], 5.0))

  def test_harness_overhead_and_host_in_closed_form(self):
    # T(m) = host + m o + B s with host 3 ms, o 0.5 ms, B s = 16 x 0.1 ms; round 2's m = M is faster: o clamped.
    single = [[3e-3 + 0.5e-3 + 1.6e-3, 3e-3 + 4 * 0.5e-3 + 1.6e-3], [5e-3, 4e-3]]
    overhead, host = calibration.fit_harness(single, 4, [3e-3 + 0.5e-3 + 1.6e-3, 1e-3], 16, 1e-4)
    np.testing.assert_allclose(overhead, [0.5e-3, 0.0], atol=1e-15)
    np.testing.assert_allclose(host, [3e-3, 0.0], atol=1e-15)  # 1 ms less a 1.6 ms micro-batch: clamped

  def test_network_recovers_the_rings_figures_and_the_harness_latency(self):
    # Two rounds of exact ring and shift timings (alpha 1e-4 s, beta 8 Gb/s: 1e-9 s per byte); the harness pays
    # 2 ms per iteration for an all-reduce among 2 of 1e5 bytes and 1 ms for an exchange. A row of 0 s is dropped.
    sizes = [4096, 65536, 1048576]
    ring = lambda n, m: 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * m * 1e-9
    rows = {'allreduce': [[r, n, m, ring(n, m)] for r in range(2) for n in (2, 3) for m in sizes] + [[0, 2, 8, 0.0]],
            'p2p': [[r, m, 1e-4 + m * 1e-9] for r in range(2) for m in sizes]}
    fit = calibration.fit_network(rows, 2, 2, [[2e-3, 1e-3]] * 2, 1e5)
    np.testing.assert_allclose(fit.allreduce, [[1e-4, 8.0]] * 2, rtol=1e-9)
    np.testing.assert_allclose(fit.p2p, [[1e-4, 8.0]] * 2, rtol=1e-9)
    np.testing.assert_allclose(fit.allreduce_latency_s, (2e-3 - 1e5 * 1e-9) / 2, rtol=1e-9)  # 2(n - 1) messages
    np.testing.assert_allclose(fit.p2p_latency_s, 1e-3 - 1e5 * 1e-9, rtol=1e-9)
    self.assertEqual(fit.dropped, 1)


class AllreduceSizesTest(parameterized.TestCase):

  @parameterized.parameters(2, 4)
  def test_two_sizes_give_the_ring_through_them(self, n):
    # A harness that pays 3 ms per message and 0.15 Gbit/s: its whole-model and fragment all-reduces give both
    # back, and the streaming rule's fragment (network.Collectives at those figures) costs what the harness paid.
    from waitless.cluster import network
    link = network.AlphaBeta(latency_s=3e-3, bandwidth_gbps=0.15)
    ring = network.Collectives(allreduce_link=link, p2p_link=link)
    nbytes = 1.2e6
    whole, fragment = ring.allreduce(nbytes, n), ring.allreduce(nbytes / 2, n)
    alpha, gbps = calibration.fit_allreduce_sizes(whole, fragment, nbytes, 2, n)
    self.assertAlmostEqual(alpha, 3e-3)
    self.assertAlmostEqual(gbps, 0.15)
    fitted = network.Collectives(allreduce_link=network.AlphaBeta(alpha, gbps), p2p_link=link)
    self.assertAlmostEqual(fitted.allreduce(nbytes / 2, n), fragment)

  def test_a_fragment_that_costs_as_much_as_the_model_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'not cheaper'):
      calibration.fit_allreduce_sizes(0.05, 0.05, 1.2e6, 2, 2)

  def test_a_latency_below_zero_is_clamped(self):
    # Half the model for 0.02 s of 0.05: the line through them crosses 0 below the origin.
    alpha, _ = calibration.fit_allreduce_sizes(0.05, 0.02, 1.2e6, 2, 2)
    self.assertEqual(alpha, 0.0)


if __name__ == '__main__':
  absltest.main()
