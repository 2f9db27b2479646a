"""Calibrating the compute model from a measured step."""

import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_collections

from cluster import calibration
from cluster import factory
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


if __name__ == '__main__':
  absltest.main()
