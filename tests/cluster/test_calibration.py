"""Calibrating the compute model from a measured step."""

import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.cluster.rules import sync
from waitless.experiments.harness import call_timing
from waitless.cluster import calibration
from waitless.cluster import factory
from waitless.experiments.configs import digits
from tests.cluster import helpers


class CalibrationTest(parameterized.TestCase):

  def test_times_a_jitted_step_and_divides_by_microbatches(self):
    step = jax.jit(lambda state, x: (state + jnp.sum(x * x), x.mean()))
    x = jnp.ones((64, 64))
    per_call = calibration.time_callable(step, jnp.zeros(()), x, repeats=3, carry=True)
    self.assertGreater(per_call, 0)
    config = ml_collections.ConfigDict({'workers': 8, 'devices': 2, 'microbatches': 2})
    self.assertEqual(calibration.microbatches_per_call(config, iterations_per_call=5), 4 * 2 * 5)
    per_microbatch = calibration.seconds_per_microbatch(step, jnp.zeros(()), x, microbatches_per_call=40,
                                                        repeats=3, carry=True)
    self.assertLess(per_microbatch, per_call)

  def test_measures_wall_time(self):
    self.assertGreater(calibration.time_callable(lambda: time.sleep(0.01), warmup=0, repeats=3), 0.009)

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

  def test_times_each_size(self):
    # A call that sleeps 10 ms + 5 ms per sample; a loaded machine only adds (wake-up latency: overhead).
    seconds = calibration.time_sizes(lambda s: (lambda: time.sleep(0.01 + 0.005 * s), ()), [1, 4], warmup=0,
                                     repeats=3)
    fit = calibration.fit_overhead([1, 4], seconds)
    self.assertAlmostEqual(fit.per_sample_s, 0.005, delta=1.5e-3)
    self.assertBetween(fit.overhead_s, 0.007, 0.016)

  def test_end_to_end_on_the_digits_mlp(self):
    # The real step at 4 and 256 samples (far apart: this machine is noisy), fitted, written into a config
    # whose clock then charges a configured micro-batch the fitted time.
    config = digits.get_config('sync')
    sizes = [4, 256]
    seconds = calibration.time_sizes(lambda s: call_timing.make_call(config, s), sizes, warmup=2, repeats=5,
                                     carry=True)
    self.assertLess(seconds[0], seconds[1])
    fit = calibration.fit_overhead(sizes, seconds)
    self.assertGreaterEqual(fit.overhead_s, 0.0)
    self.assertGreater(fit.per_sample_s, 0.0)
    unit = config.batch_size // config.microbatches
    config.stragglers = calibration.calibrated(config.stragglers, fit.seconds(unit), overhead_s=fit.overhead_s)
    factory.validate(config)
    clock = factory.make_clock(config, sync.Barrier(config.microbatches), 1e4)
    np.testing.assert_allclose(clock.next_block(3).duration, config.microbatches * fit.seconds(unit), rtol=1e-12)


if __name__ == '__main__':
  absltest.main()
