"""The `ALGORITHM[,key=value...]` config argument and the shipped configs."""

import importlib

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import factory
from waitless.cluster import registry
from waitless.experiments.harness import validation
from waitless.experiments.configs import arguments
from waitless.experiments.configs import digits
from waitless.experiments.configs import synthetic


class IntAndNumberTest(parameterized.TestCase):

  @parameterized.parameters(3, np.int32(3), np.int64(-2), np.uint8(7))
  def test_integers(self, value):
    self.assertTrue(errors.is_int(value))
    self.assertTrue(errors.is_number(value))

  @parameterized.parameters(0.5, np.float32(0.5), np.float64(-2.0))
  def test_numbers_that_are_not_integers(self, value):
    self.assertFalse(errors.is_int(value))
    self.assertTrue(errors.is_number(value))

  @parameterized.parameters((True,), (np.bool_(False),), ('3',), (None,), ((1,),), (float('nan'),),
                            (np.float32('inf'),))
  def test_neither(self, value):
    self.assertFalse(errors.is_int(value))
    self.assertFalse(errors.is_number(value))


class ConfigArgTest(parameterized.TestCase):

  def test_split_keeps_bracketed_commas(self):
    self.assertEqual(arguments.split_arg('sync,stragglers.slow_workers=(0,3),workers=8'),
                     ['sync', 'stragglers.slow_workers=(0,3)', 'workers=8'])
    self.assertEqual(arguments.split_arg(None), [])

  def test_one_rule_names_the_field_of_a_key(self):
    config = digits.get_config('local_sgd')
    self.assertEqual(arguments.resolve_key(config, 'local_steps'), 'algorithm.local_steps')
    self.assertEqual(arguments.resolve_key(config, 'workers'), 'workers')
    self.assertEqual(arguments.resolve_key(config, 'optimizer.momentum'), 'optimizer.momentum')
    self.assertEqual(arguments.pairs('ksync,k=6,stragglers.slow_workers=(0,3)'),
                     ['k=6', 'stragglers.slow_workers=(0,3)'])

  def test_flags_replace_the_duration_and_win_over_a_profile(self):
    config = digits.get_config('sync,num_epochs=2')
    config.num_steps = 7  # what config_flags sets for --config.num_steps=7
    arguments.apply_flag_rules(config, ['num_steps', 'network.kind', 'optimizer.momentum'])
    self.assertEqual((config.num_steps, config.num_epochs), (7, None))
    self.assertEqual(config.cluster.explicit, ('network.kind',))
    config = digits.get_config('sync,stragglers.base_s=0.02')
    self.assertEqual(config.cluster.explicit, ('stragglers.base_s',))  # the argument's pairs are explicit too

  def test_bare_keys_resolve_to_algorithm_then_top_level(self):
    config = digits.get_config('local_sgd,local_steps=7,workers=16,optimizer.learning_rate=1')
    self.assertEqual(config.algorithm.local_steps, 7)
    self.assertEqual(config.workers, 16)
    self.assertEqual(config.optimizer.learning_rate, 1.0)
    self.assertIsInstance(config.optimizer.learning_rate, float)

  def test_algorithm_defaults_come_from_the_registry(self):
    config = digits.get_config('local_sgd')
    self.assertEqual(dict(config.algorithm), {'name': 'local_sgd', **registry.get('local_sgd').defaults})
    self.assertEqual(dict(digits.get_config('sync').algorithm), {'name': 'sync'})

  @parameterized.named_parameters(
      ('unknown_algorithm', 'nope', 'algorithm.name'),
      ('unknown_key', 'sync,bogus=1', 'unknown key'),
      ('unknown_path', 'sync,optimizer.bogus=1', 'unknown key'),
      ('not_key_value', 'sync,workers', 'expected key=value'),
      ('wrong_type', 'sync,workers=eight', 'must be of type int'),
      # Issue 59: a key given twice was accepted, the last winning.
      ('key_twice', 'wagma,workers=8,workers=16', r'sets workers twice \(workers=8 and workers=16\): give it once'),
      ('algorithm_key_twice', 'local_sgd,local_steps=2,algorithm.local_steps=3', 'sets algorithm.local_steps twice'),
      ('field_twice', 'sync,stragglers.rate=2.0,stragglers.rate=3.0', 'sets stragglers.rate twice'))
  def test_bad_arguments(self, arg, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      digits.get_config(arg)

  def test_an_entry_replaces_the_common_pairs_it_names_but_not_its_own(self):
    config = arguments.entry_config(digits.get_config, 'ksync,k=2,workers=8', (('optimizer.learning_rate', '0.5'),),
                                    ['workers=4', 'devices=4'])
    self.assertEqual((config.workers, config.devices, config.algorithm.k), (8, 4, 2))
    with self.assertRaisesRegex(errors.ConfigError, 'sets algorithm.k twice'):
      arguments.entry_config(digits.get_config, 'ksync,k=2,k=3', (), ['workers=4'])

  @parameterized.named_parameters(*[(f'{module.__name__.split(".")[-1]}_{name}', module, name)
                                    for module in (digits, synthetic) for name in registry.names()])
  def test_every_algorithm_gives_a_valid_config(self, module, name):
    validation.validate(module.get_config(name))

  @parameterized.named_parameters(*[(f'{w}_{p}', w, p) for w in ('digits', 'synthetic', 'mnist1d', 'cifar10',
                                                                  'cifar100', 'imagenet', 'wmt', 'digits_stale')
                                      for p in arguments.STRAGGLER_PRESETS])
  def test_every_workload_offers_the_straggler_presets(self, workload, preset):
    # Every workload's config argument takes every preset (not only mnist1d.py's).
    module = importlib.import_module(f'waitless.experiments.configs.{workload}')
    config = module.get_config(f'sync,stragglers={preset}')
    validation.validate(config)
    if preset == 'heterogeneous':
      self.assertEqual((config.stragglers.slow_fraction, config.stragglers.delayed_workers), (0.25, 1))
      # Three calls of the workload's own compute model (digits_stale's mean 1 s exponential: 3 s, not 3 x base_s).
      call = factory.make_compute(config.stragglers, config.workers).mean()
      unslowed = call / factory.slow_factors(config.stragglers, config.workers).mean()
      self.assertAlmostEqual(factory.delay_seconds(config.stragglers, config.workers), 3 * unslowed)
    if preset == 'sqrt':
      self.assertLen(config.stragglers.worker_factors, config.workers)
    with self.assertRaisesRegex(errors.ConfigError, '^stragglers=.bogus. is not allowed: a preset: homogeneous, '
                                'heterogeneous, sqrt'):
      module.get_config('sync,stragglers=bogus')

  def test_a_seed_beyond_the_programs_range_is_one_line(self):
    # A seed is an int32 in the replicas' program: beyond it (10**20, 2**63 - 1, 2**31), or a last seed of --seeds
    # beyond it, is one ConfigError naming the field, neither an OverflowError nor a seed that wraps around.
    config = digits.get_config('sync')
    for seed in (10**20, 2**63 - 1, 2**31, -1):
      config.seed = seed
      with self.assertRaisesRegex(errors.ConfigError, rf'^seed={seed} is not allowed: must be an integer in '
                                  r'0\.\.2147483647'):
        validation.validate(config)
    config.seed = 2**31 - 1
    validation.validate(config)
    validation.check_seeds(2**31 - 1, 1)
    with self.assertRaisesRegex(errors.ConfigError, r'^--seeds=2 is not allowed: the last seed, config.seed \+ 1 = '
                                r'2147483648, must be <= 2147483647'):
      validation.check_seeds(2**31 - 1, 2)


if __name__ == '__main__':
  absltest.main()
