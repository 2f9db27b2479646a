"""The MNIST-1D workload config: every algorithm accepted, the straggler presets, short end-to-end runs."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from waitless import config_errors as errors
from waitless.cluster import factory
from waitless.cluster import registry
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from waitless.experiments.configs import arguments
from waitless.experiments.configs import mnist1d


def _tiny(arg: str, steps: int = 4):
  config = mnist1d.get_config(arg)
  config.num_steps = steps
  config.eval_every = config.checkpoint_every = config.steps_per_call = 2
  config.log_every = 1
  return config


class Mnist1dConfigTest(parameterized.TestCase):

  @parameterized.parameters(*registry.names())
  def test_every_registered_algorithm_is_accepted(self, name):
    for preset in arguments.STRAGGLER_PRESETS:
      config = mnist1d.get_config(f'{name},stragglers={preset}')
      validation.validate(config)
      self.assertEqual(config.algorithm.name, name)
    self.assertEqual(config.model.name, 'cnn1d')

  def test_heterogeneous_preset_is_the_documented_flags(self):
    config = mnist1d.get_config('sync,stragglers=heterogeneous')
    by_flags = mnist1d.get_config('sync,stragglers.slow_fraction=0.25,stragglers.slow_factor=2.0,'
                                  'stragglers.delayed_workers=1,stragglers.delay_calls=3.0,stragglers.delay_s=0')
    self.assertEqual(config.to_dict(), by_flags.to_dict())
    self.assertEqual(factory.delay_seconds(config.stragglers, config.workers), 0.03)
    self.assertEqual(config.stragglers.slow_fraction, 0.25)
    self.assertEqual(mnist1d.get_config('sync,stragglers=homogeneous').to_dict(),
                     mnist1d.get_config('sync').to_dict())
    # Later entries override the preset, wherever the preset is written.
    overridden = mnist1d.get_config('sync,stragglers.delay_s=0.05,stragglers=heterogeneous')
    validation.validate(overridden)  # the preset's delay in calls gives way to the argument's in seconds
    self.assertEqual((overridden.stragglers.delay_s, overridden.stragglers.delay_calls), (0.05, 0.0))
    self.assertEqual(mnist1d.get_config('local_sgd,local_steps=3,stragglers=heterogeneous').algorithm.local_steps, 3)

  def test_sqrt_preset_scales_worker_i_by_sqrt_i_plus_1(self):
    config = mnist1d.get_config('ringmaster,stragglers=sqrt')
    validation.validate(config)
    np.testing.assert_allclose(config.stragglers.worker_factors, np.sqrt(np.arange(1, 9)), rtol=1e-15)
    # Sized for the workers the argument asks for, before or after the preset.
    for arg in ('sync,workers=4,devices=4,stragglers=sqrt', 'sync,stragglers=sqrt,workers=4,devices=4'):
      config = mnist1d.get_config(arg)
      validation.validate(config)
      np.testing.assert_allclose(config.stragglers.worker_factors, np.sqrt([1, 2, 3, 4]), rtol=1e-15)
    # A later flag (`--config.workers=4`) does not resize it: validation names the mismatch.
    config = mnist1d.get_config('sync,stragglers=sqrt')
    config.workers = config.devices = 4
    with self.assertRaisesRegex(errors.ConfigError, 'has 8 factors.*workers=4') as caught:
      validation.validate(config)
    self.assertEqual(caught.exception.field, 'stragglers.worker_factors')
    # An explicit entry wins over the preset; mixing with the 2x-slow-workers preset is refused.
    self.assertEqual(mnist1d.get_config('sync,stragglers=sqrt,stragglers.worker_factors=()').stragglers.worker_factors,
                     ())
    with self.assertRaisesRegex(errors.ConfigError, 'not both'):
      validation.validate(mnist1d.get_config('sync,stragglers=heterogeneous,stragglers=sqrt'))

  def test_unknown_preset_names_the_field(self):
    with self.assertRaisesRegex(errors.ConfigError, 'stragglers.*heterogeneous'):
      mnist1d.get_config('sync,stragglers=slow')


class Mnist1dEndToEndTest(parameterized.TestCase):

  @parameterized.parameters(('sync', 'cnn1d'), ('local_sgd,local_steps=2', 'mlp'))
  def test_a_few_steps(self, arg, model):
    config = _tiny(f'{arg},model.name={model},stragglers=heterogeneous')
    summary = train.train_and_evaluate(config, self.create_tempdir().full_path)
    self.assertEqual(summary['steps'], 4)
    self.assertTrue(math.isfinite(summary['final_train_loss']))
    self.assertBetween(summary['final_eval_accuracy'], 0.0, 1.0)
    # Slow workers and delays: an iteration of 10 ms micro-batches takes longer than 10 ms.
    self.assertGreater(summary['sim_time'], 4 * 0.01)

  @pytest.mark.slow
  def test_sync_default_learns(self):
    summary = train.train_and_evaluate(mnist1d.get_config('sync'), self.create_tempdir().full_path)
    self.assertGreaterEqual(summary['final_eval_accuracy'], 0.85)  # measured 0.90 (docstring)
    self.assertAlmostEqual(summary['sim_time'], 300 * 0.01, places=9)


if __name__ == '__main__':
  absltest.main()
