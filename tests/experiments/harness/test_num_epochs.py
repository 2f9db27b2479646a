"""`num_epochs` as the alternative to `num_steps`: exactly one is set, resolved once from the training split."""

import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import tensorflow_datasets as tfds

from waitless import config_errors as errors
from waitless.experiments.configs import cifar10
from waitless.experiments.configs import digits
from waitless.experiments.configs import imagenet
from waitless.experiments.harness import duration
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from waitless.experiments.harness import validation

DIGITS_TRAIN = 1437  # 80% of the 1,797 digits


class StepsForEpochsTest(parameterized.TestCase):

  @parameterized.parameters(
      (200, 50_000, 8, 32, 39_063),      # cifar10.py: 39,062.5 iterations, rounded up
      (300, 50_000, 2, 256, 29_297),     # LAP-SGD's 300 epochs on 2 nodes of 256
      (90, 1_281_167, 64, 128, 14_076),  # imagenet.py
      (2, 4096, 8, 32, 32),              # whole iterations: no extra one
      (0.001, 100, 8, 32, 1))            # at least one iteration
  def test_formula(self, epochs, train_size, workers, batch_size, steps):
    self.assertEqual(duration.steps_for_epochs(epochs, train_size, workers, batch_size), steps)
    # At least `epochs` passes, and one iteration fewer would be less (global batch = workers x batch_size).
    self.assertGreaterEqual(steps * workers * batch_size, epochs * train_size)
    if steps > 1:
      self.assertLess((steps - 1) * workers * batch_size, epochs * train_size)


class DurationValidationTest(parameterized.TestCase):

  def test_shipped_configs(self):
    for module, epochs in ((cifar10, 200.0), (imagenet, 90.0)):
      config = module.get_config('sync')
      self.assertEqual((config.num_steps, config.num_epochs), (None, epochs))
      validation.validate(config)
    config = digits.get_config('sync')
    self.assertEqual((config.num_steps, config.num_epochs), (300, None))

  def test_the_config_argument_replaces_the_duration(self):
    config = cifar10.get_config('sync,num_steps=20')
    self.assertEqual((config.num_steps, config.num_epochs), (20, None))
    validation.validate(config)
    config = digits.get_config('sync,num_epochs=2')
    self.assertEqual((config.num_steps, config.num_epochs), (None, 2.0))
    self.assertIsInstance(config.num_epochs, float)
    validation.validate(config)
    # After a replacement the other field can be set again (a placeholder of its type).
    config.num_steps, config.num_epochs = 7, None
    validation.validate(config)

  @parameterized.named_parameters(('both', 300, 2.0), ('neither', None, None))
  def test_exactly_one_is_set(self, steps, epochs):
    config = digits.get_config('sync')
    config.num_steps, config.num_epochs = steps, epochs
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(config)
    self.assertIn('num_steps, num_epochs', str(raised.exception))
    self.assertIn('exactly one', str(raised.exception))

  @parameterized.named_parameters(('zero', 0.0), ('negative', -1.0), ('nan', math.nan), ('inf', math.inf),
                                  ('text', 'ten'))
  def test_bad_num_epochs(self, epochs):
    config = digits.get_config('sync,num_epochs=1')
    with config.ignore_type():
      config.num_epochs = epochs
    with self.assertRaisesRegex(errors.ConfigError, r'^num_epochs='):
      validation.validate(config)

  def test_bad_num_steps(self):
    with self.assertRaisesRegex(errors.ConfigError, r'^num_steps=0 '):
      validation.validate(digits.get_config('sync,num_steps=0'))


class ResolutionTest(absltest.TestCase):

  def test_build_resolves_once_from_the_training_split(self):
    config = digits.get_config('sync,num_epochs=2.5')
    run = setup.build(config)
    # ceil(2.5 x 1,437 / (8 workers x 16)) = ceil(28.07)
    self.assertEqual(run.config.num_steps, 29)
    self.assertIsNone(run.config.num_epochs)
    self.assertEqual(run.dataset.train_size, DIGITS_TRAIN)
    # The caller's config is left as given; a config in steps is used as it is.
    self.assertEqual((config.num_steps, config.num_epochs), (None, 2.5))
    steps_config = digits.get_config('sync')
    self.assertIs(setup.build(steps_config).config, steps_config)
    # Workers and batch size given after the epochs change the resolved steps: global batch 4 x 16.
    self.assertEqual(setup.build(digits.get_config('sync,num_epochs=2.5,workers=4,devices=4'))
                     .config.num_steps, 57)
    self.assertEqual(setup.build(digits.get_config('sync,num_epochs=1,batch_size=8')).config.num_steps,
                     math.ceil(DIGITS_TRAIN / 64))

  def test_a_tfds_workload_resolves_from_its_training_split(self):
    config = cifar10.get_config('sync,model.name=resnet_test,workers=2,devices=2,batch_size=4,num_epochs=1.5')
    with tfds.testing.mock_data(num_examples=32):
      run = setup.build(config)
    self.assertEqual((run.dataset.train_size, run.config.num_steps), (32, 6))  # 1.5 x 32 / (2 x 4)

  def test_checks_on_the_number_of_steps_apply_to_the_resolved_one(self):
    config = digits.get_config('adasync,num_epochs=0.1')
    validation.validate(config)  # the steps are not known yet
    with self.assertRaisesRegex(errors.ConfigError, r'^num_steps=2 .*adasync needs'):
      setup.build(config)  # ceil(0.1 x 1,437 / 128) = 2 iterations: too few for AdaSync

  def test_a_run_in_epochs_trains_the_resolved_steps_and_resumes(self):
    config = digits.get_config('sync,num_epochs=0.5,eval_every=5,checkpoint_every=5,log_every=5,steps_per_call=5')
    workdir = self.create_tempdir().full_path
    summary = train.train_and_evaluate(config, workdir)
    self.assertEqual(summary['steps'], math.ceil(0.5 * DIGITS_TRAIN / 128))  # 6
    with open(os.path.join(workdir, 'config.json')) as f:
      saved = json.load(f)
    self.assertEqual((saved['num_steps'], saved['num_epochs']), (None, 0.5))  # as given
    again = train.train_and_evaluate(digits.get_config(
        'sync,num_epochs=0.5,eval_every=5,checkpoint_every=5,log_every=5,steps_per_call=5'), workdir)
    self.assertEqual(again['steps'], summary['steps'])
    self.assertEqual(again['final_eval_accuracy'], summary['final_eval_accuracy'])


if __name__ == '__main__':
  absltest.main()
