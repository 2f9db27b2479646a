"""Config validation and defaults of `cluster.factory`."""

import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.cluster.rules import sync
from waitless.cluster import compute
from waitless.cluster import factory
from waitless.cluster import network
from tests.cluster import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ValidateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('unknown_kind', {'kind': 'gamma'}, 'stragglers.kind', 'known: constant'),
      ('base_not_positive', {'base_s': 0.0}, 'stragglers.base_s', '> 0'),
      ('overhead_negative', {'overhead_s': -1e-3}, 'stragglers.overhead_s', r'overhead_s=-0.001 .*>= 0'),
      ('overhead_not_a_number', {'overhead_s': 'fast'}, 'stragglers.overhead_s', 'seconds per call'),
      ('overhead_infinite', {'overhead_s': float('inf')}, 'stragglers.overhead_s', '>= 0'),
      ('negative_rate', {'kind': 'exponential', 'rate': -1.0}, 'stragglers.rate', '> 0'),
      ('negative_shift', {'kind': 'shifted_exponential', 'shift_s': -0.1}, 'stragglers.shift_s', '>= 0'),
      ('pareto_shape', {'kind': 'pareto', 'shape': 0.0}, 'stragglers.shape', '> 0'),
      ('pareto_scale', {'kind': 'pareto', 'scale': -1.0}, 'stragglers.scale', '> 0'),
      ('lognormal_sigma', {'kind': 'lognormal', 'sigma': -0.5}, 'stragglers.sigma', '>= 0'),
      ('fraction_above_one', {'slow_fraction': 1.5}, 'stragglers.slow_fraction', r'\[0, 1\]'),
      ('fraction_negative', {'slow_fraction': -0.1}, 'stragglers.slow_fraction', r'\[0, 1\]'),
      ('slow_factor', {'slow_factor': 0.0}, 'stragglers.slow_factor', '> 0'),
      ('slow_worker_out_of_range', {'slow_workers': (8,)}, 'stragglers.slow_workers', r'0\.\.7'),
      ('slow_both', {'slow_workers': (1,), 'slow_fraction': 0.5}, 'stragglers.slow_workers', 'not both'),
      ('slow_kind_without_slow', {'kind': 'slow_workers'}, 'stragglers.slow_fraction', 'needs'),
      ('delayed_too_many', {'delayed_workers': 9}, 'stragglers.delayed_workers', r'0\.\.8'),
      ('delay_negative', {'delay_s': -1.0}, 'stragglers.delay_s', '>= 0'),
      # Beyond MAX_SECONDS the clock's sums overflow and read as workers that never finish.
      ('delay_overflows', {'delayed_workers': 2, 'delay_s': 1e308}, 'stragglers.delay_s', r'<= 1e\+06'),
      ('base_overflows', {'base_s': 1e300}, 'stragglers.base_s', r'<= 1e\+06'),
      ('overhead_overflows', {'overhead_s': 1e300}, 'stragglers.overhead_s', r'<= 1e\+06'),
      ('delay_calls_negative', {'delay_calls': -1.0}, 'stragglers.delay_calls', '>= 0'),
      ('delay_in_seconds_and_calls', {'delayed_workers': 1, 'delay_s': 0.03, 'delay_calls': 3.0},
       'stragglers.delay_calls', 'both set the delay: set one of them'),
      ('random_delay_without_workers', {'kind': 'random_delay', 'delay_s': 0.3}, 'stragglers.delayed_workers',
       '>= 1'),
      ('trace_missing', {'kind': 'trace', 'trace_path': '/no/such/file.npy'}, 'stragglers.trace_path',
       'not found'),
      ('trace_empty_path', {'kind': 'trace'}, 'stragglers.trace_path', 'needs the path'),
      ('fail_worker', {'fail_worker': 12}, 'stragglers.fail_worker', 'worker ids'),
      ('return_before_fail', {'fail_worker': 1, 'fail_at_s': 2.0, 'return_at_s': 1.0}, 'stragglers.return_at_s',
       '> fail_at_s'),
      ('rate_not_a_number', {'kind': 'exponential', 'rate': 'fast'}, 'stragglers.rate', '> 0'),
      ('factors_too_few', {'worker_factors': (1.0, 2.0)}, 'stragglers.worker_factors', r'has 2 .*workers=8'),
      ('factors_too_many', {'worker_factors': (1.0,) * 9}, 'stragglers.worker_factors', r'has 9 .*workers=8'),
      ('factor_zero', {'worker_factors': (1.0,) * 7 + (0.0,)}, 'stragglers.worker_factors', 'finite number > 0'),
      ('factor_negative', {'worker_factors': (-1.0,) + (1.0,) * 7}, 'stragglers.worker_factors', '> 0'),
      ('factor_nan', {'worker_factors': (float('nan'),) * 8}, 'stragglers.worker_factors', 'finite'),
      ('factor_inf', {'worker_factors': (float('inf'),) * 8}, 'stragglers.worker_factors', 'finite'),
      ('factor_text', {'worker_factors': ('x',) * 8}, 'stragglers.worker_factors', 'finite number'),
      ('factor_bool', {'worker_factors': (True,) * 8}, 'stragglers.worker_factors', 'finite number'),
      ('factors_not_a_tuple', {'worker_factors': 2.0}, 'stragglers.worker_factors', 'tuple of 8'),
      ('factors_and_fraction', {'worker_factors': (1.0,) * 8, 'slow_fraction': 0.25}, 'stragglers.worker_factors',
       'not both'),
      ('factors_and_slow_workers', {'worker_factors': (1.0,) * 8, 'slow_workers': (0,)},
       'stragglers.worker_factors', 'not both'),
      ('delay_draws', {'delay_draws': 'with_replacement'}, 'stragglers.delay_draws', 'distinct, independent'),
  )
  def test_bad_stragglers(self, overrides, field, allowed):
    config = helpers.config(workers=8)
    with config.stragglers.ignore_type():
      for key, value in overrides.items():
        config.stragglers[key] = value
    with self.assertRaisesRegex(errors.ConfigError, allowed) as caught:
      factory.validate(config)
    self.assertEqual(caught.exception.field, field)

  def test_trace_with_wrong_worker_count(self):
    path = self.create_tempfile('trace.npy').full_path
    np.save(path, np.full((10, 4), 0.01))
    with self.assertRaisesRegex(errors.ConfigError, 'workers=8') as caught:
      factory.validate(helpers.config(workers=8, kind='trace', trace_path=path))
    self.assertEqual(caught.exception.field, 'stragglers.trace_path')
    factory.validate(helpers.config(workers=4, kind='trace', trace_path=path))

  @parameterized.named_parameters(
      ('unknown', {'kind': 'infiniband'}, 'network.kind'),
      ('latency', {'kind': 'alpha_beta', 'latency_s': -1.0}, 'network.latency_s'),
      ('bandwidth', {'kind': 'alpha_beta', 'bandwidth_gbps': 0.0}, 'network.bandwidth_gbps'),
  )
  def test_bad_network(self, overrides, field):
    with self.assertRaises(errors.ConfigError) as caught:
      factory.validate(helpers.config(network=overrides))
    self.assertEqual(caught.exception.field, field)

  def test_defaults_are_valid_and_unchanged(self):
    config = helpers.config()
    factory.validate(config)
    self.assertEqual(config.stragglers.kind, 'constant')
    self.assertEqual(config.stragglers.base_s, 0.01)
    self.assertEqual(config.network.kind, 'ideal')

  def test_every_kind_with_its_defaults_is_valid(self):
    path = self.create_tempfile('trace.npy').full_path
    np.save(path, np.full((3, 8), 0.01))
    for kind in factory.STRAGGLER_KINDS:
      extra = {'trace': {'trace_path': path}, 'slow_workers': {'slow_fraction': 0.25},
               'random_delay': {'delayed_workers': 2, 'delay_s': 0.32}}.get(kind, {})
      config = helpers.config(kind=kind, **extra)
      factory.validate(config)
      clock = factory.make_clock(config, sync.Barrier(), 1e6)
      self.assertTrue(np.all(clock.next_block(3).duration > 0), kind)

  def test_validate_returns_the_cost_model_the_clock_charges(self):
    config = helpers.config(base_s=0.02, network={'kind': 'alpha_beta'})
    cost = factory.validate(config)
    self.assertEqual((cost.stragglers.base_s, cost.host_s, cost.profile), (0.02, 0.0, ''))
    self.assertIsInstance(cost.network, network.AlphaBeta)
    clock = factory.make_clock(config, sync.Barrier(), 1e6, cost)
    self.assertIs(clock.network, cost.network)
    np.testing.assert_allclose(clock.next_block(2).duration, 0.02 + cost.network.allreduce(1e6, 8))


class MakeTest(absltest.TestCase):

  def test_network_model(self):
    net = factory.make_network(ml_collections.ConfigDict(
        {'kind': 'alpha_beta', 'latency_s': 1e-5, 'bandwidth_gbps': 8.0}))
    self.assertIsInstance(net, network.AlphaBeta)
    nbytes = 1e6
    self.assertAlmostEqual(net.allreduce(nbytes, 4), 6 * 1e-5 + 1.5 * nbytes * 1e-9)
    self.assertAlmostEqual(net.p2p(nbytes), 1e-5 + nbytes * 1e-9)
    self.assertEqual(net.allreduce(nbytes, 1), 0.0)
    self.assertEqual(net.latency(), 1e-5)

  def test_worker_factors_scale_each_worker(self):
    factors = tuple(np.sqrt(np.arange(1, 9)))
    config = helpers.config(workers=8, base_s=0.01, worker_factors=factors)
    factory.validate(config)
    np.testing.assert_array_equal(factory.slow_factors(config.stragglers, 8), factors)
    clock = factory.make_clock(config, sync.Barrier(), 1e6)
    self.assertIsInstance(clock.compute, compute.SlowWorkers)
    workers = np.arange(8)
    np.testing.assert_allclose(clock.compute.sample(np.random.default_rng(0), workers, np.zeros(8, np.int64)),
                               0.01 * np.sqrt(workers + 1), rtol=1e-12)
    # Sync waits for the slowest worker: sqrt(8) x 10 ms per iteration.
    np.testing.assert_allclose(clock.next_block(3).duration, 0.01 * np.sqrt(8), rtol=1e-12)
    # They take the place of slow_fraction / slow_factor, and compose with the distribution and delays.
    config = helpers.config(workers=4, kind='slow_workers', slow_factor=5.0, worker_factors=(1, 2, 3, 4),
                            delayed_workers=1, delay_s=0.1)
    factory.validate(config)
    np.testing.assert_array_equal(factory.slow_factors(config.stragglers, 4), [1.0, 2.0, 3.0, 4.0])

  def test_empty_worker_factors_change_nothing(self):
    config = helpers.config(workers=4, slow_workers=(1,), slow_factor=3.0, worker_factors=())
    factory.validate(config)
    np.testing.assert_array_equal(factory.slow_factors(config.stragglers, 4), [1.0, 3.0, 1.0, 1.0])
    self.assertEqual(helpers.config().stragglers.worker_factors, ())

  def test_composition(self):
    clock = helpers.clock(sync.Barrier(), kind='exponential', slow_workers=(0,), delayed_workers=1,
                          delay_s=0.1, fail_worker=(2, 3), fail_at_s=1.0, return_at_s=2.0)
    self.assertIsInstance(clock.compute, compute.SlowWorkers)
    self.assertIsInstance(clock.compute.base, compute.Exponential)
    self.assertEqual(clock.delay.count, 1)
    self.assertEqual(clock.failure.failed, (2, 3))
    self.assertEqual(clock.lost_workers, 0)


class ImportDirectionTest(absltest.TestCase):

  def test_the_clock_imports_no_rule_module(self):
    # Rules import the clock; the clock reads what they return from `cluster.schedules`.
    code = ('import sys, waitless.cluster.clock; '
            'print(sorted(m for m in sys.modules if m.startswith("waitless.cluster.rules")))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                         env={**os.environ, 'PYTHONPATH': ROOT})
    self.assertEqual(out.stdout.strip(), '[]')

  def test_make_clock_checks_the_rule(self):
    with self.assertRaisesRegex(TypeError, 'is not a cluster.rules.base.TimeRule'):
      factory.make_clock(helpers.config(workers=2), object(), 1e3)


if __name__ == '__main__':
  absltest.main()
