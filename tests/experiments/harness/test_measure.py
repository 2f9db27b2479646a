"""Measuring this machine: timing a call, a micro-batch of a config's model, and a run's calibrated clock."""

import json
import os
import time
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless.cluster import calibration
from waitless.cluster import factory
from waitless.cluster.rules import sync
from waitless.experiments.configs import digits
from waitless.experiments.harness import measure
from waitless.experiments.harness import train
from tests import harness


def _summary_without_wall(workdir):
  with open(os.path.join(workdir, 'summary.json')) as f:
    return {k: v for k, v in json.load(f).items() if k != 'wall_time'}


class TimingTest(absltest.TestCase):

  def test_times_a_jitted_step_and_divides_by_microbatches(self):
    step = jax.jit(lambda state, x: (state + jnp.sum(x * x), x.mean()))
    x = jnp.ones((64, 64))
    per_call = measure.time_callable(step, jnp.zeros(()), x, repeats=3, carry=True)
    self.assertGreater(per_call, 0)
    config = ml_collections.ConfigDict({'workers': 8, 'devices': 2, 'microbatches': 2})
    self.assertEqual(measure.microbatches_per_call(config, iterations_per_call=5), 4 * 2 * 5)
    per_microbatch = measure.seconds_per_microbatch(step, jnp.zeros(()), x, microbatches_per_call=40, repeats=3,
                                                    carry=True)
    self.assertLess(per_microbatch, per_call)

  def test_measures_wall_time(self):
    self.assertGreater(measure.time_callable(lambda: time.sleep(0.01), warmup=0, repeats=3), 0.009)

  def test_a_harness_runs_pairs_leave_out_the_keys_it_sets(self):
    # calibrate's --config=...:sync,microbatches=4 was refused by every harness run: microbatches given twice.
    pairs = measure.harness_pairs('sync,microbatches=4,batch_size=32,workers=8', 'dpsgd', 2, 1, 20)
    self.assertEqual(pairs.split(',')[:2], ['dpsgd', 'batch_size=32'])
    keys = [p.split('=', 1)[0] for p in pairs.split(',')[1:]]
    self.assertLen(set(keys), len(keys))
    self.assertIn('microbatches=1', pairs.split(','))
    self.assertIn('workers=2', pairs.split(','))

  def test_times_each_size(self):
    # A call that sleeps 10 ms + 5 ms per sample; a loaded machine only adds (wake-up latency: overhead).
    seconds = measure.time_sizes(lambda s: (lambda: time.sleep(0.01 + 0.005 * s), ()), [1, 4], warmup=0, repeats=3)
    fit = calibration.fit_overhead([1, 4], seconds)
    self.assertAlmostEqual(fit.per_sample_s, 0.005, delta=1.5e-3)
    self.assertBetween(fit.overhead_s, 0.007, 0.016)

  def test_end_to_end_on_the_digits_mlp(self):
    # The real step at 4 and 256 samples (far apart: this machine is noisy), fitted, written into a config
    # whose clock then charges a configured micro-batch the fitted time.
    config = digits.get_config('sync')
    sizes = [4, 256]
    seconds = measure.time_sizes(lambda s: measure.microbatch_call(config, s), sizes, warmup=2, repeats=5, carry=True)
    self.assertLess(seconds[0], seconds[1])
    fit = calibration.fit_overhead(sizes, seconds)
    self.assertGreaterEqual(fit.overhead_s, 0.0)
    self.assertGreater(fit.per_sample_s, 0.0)
    unit = config.batch_size // config.microbatches
    config.stragglers = calibration.calibrated(config.stragglers, fit.seconds(unit), overhead_s=fit.overhead_s)
    factory.validate(config)
    clock = factory.make_clock(config, sync.Barrier(config.microbatches), 1e4)
    np.testing.assert_allclose(clock.next_block(3).duration, config.microbatches * fit.seconds(unit), rtol=1e-12)


class CalibratedStragglersTest(absltest.TestCase):
  """`stragglers.calibrate=True` runs through `train_and_evaluate`."""

  def test_calibration_scales_the_clock_and_leaves_the_trajectory(self):
    plain = self.create_tempdir().full_path
    calibrated = self.create_tempdir().full_path
    config = lambda: harness.synthetic_config('sync', num_steps=10, eval_every=10, **{'stragglers.calibrate': True})
    train.train_and_evaluate(harness.synthetic_config('sync', num_steps=10, eval_every=10), plain)
    summary = train.train_and_evaluate(config(), calibrated)
    with open(os.path.join(calibrated, 'calibration.json')) as f:
      seconds = json.load(f)['seconds_per_microbatch']
    self.assertGreater(seconds, 0)
    self.assertAlmostEqual(summary['sim_time'], 10 * seconds, places=9)  # constant model, ideal network
    self.assertEqual(summary['param_norm'], _summary_without_wall(plain)['param_norm'])

  def test_calibration_fits_the_overhead_from_two_micro_batch_sizes(self):
    config = lambda: harness.synthetic_config('sync', num_steps=10, eval_every=10, microbatches=2,
                                              **{'stragglers.calibrate': True})
    line = lambda run, *_: 0.002 + 1e-4 * run.config.batch_size / run.config.microbatches
    workdir = self.create_tempdir().full_path
    with mock.patch.object(measure, '_run_seconds_per_microbatch', side_effect=line):
      summary = train.train_and_evaluate(config(), workdir)
    with open(os.path.join(workdir, 'calibration.json')) as f:
      saved = json.load(f)
    size = config().batch_size // 2
    self.assertEqual(saved['sizes'], [size, size // 2])  # the config's, and half of it
    self.assertAlmostEqual(saved['overhead_s'], 0.002, places=12)
    self.assertAlmostEqual(saved['seconds_per_microbatch'], 0.002 + 1e-4 * size, places=12)
    self.assertAlmostEqual(summary['sim_time'], 10 * 2 * saved['seconds_per_microbatch'], places=9)  # m = 2 calls
    # Times that do not grow with the size (noise on a tiny model): the configured overhead is kept.
    workdir = self.create_tempdir().full_path
    with mock.patch.object(measure, '_run_seconds_per_microbatch', side_effect=[0.003, 0.004]):
      train.train_and_evaluate(config(), workdir)
    with open(os.path.join(workdir, 'calibration.json')) as f:
      self.assertNotIn('overhead_s', json.load(f))


if __name__ == '__main__':
  absltest.main()
