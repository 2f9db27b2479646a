"""Parameter-server family: each variant replayed event by event in a sequential float64 server loop.

The harness runs the shard_map emulation (every worker holds the server copy, its params are its learner's
view) on least squares with exponential compute times; the reference is a plain parameter server in numpy:
one model W with its version history, one view per learner, gradients pushed exactly as the schedule says
(the first on the learner's view, later ones of a K-batch learner on the W it fetched in between), one update
per iteration, then fetches. Views are compared after every iteration, the server copy at the end.
"""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import parameter_server
from waitless.experiments.configs import arguments
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from tests import harness
from tests.algorithms.parameter_server_reference import replay

P = 4


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{
      'model.param_dtype': 'float64', 'model.dtype': 'float64', 'stragglers.kind': 'exponential',
      'stragglers.rate': 100.0, **overrides})


def _staleness(traj):
  return max(int(s.staleness.max()) for s in traj.schedules)


class ParameterServerTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('ksync', 'ksync,k=2', 'ksync', {}),
      ('ksync_momentum_microbatches', 'ksync,k=3', 'ksync', {'optimizer.momentum': 0.9, 'microbatches': 2}),
      ('kbatch_sync', 'kbatch_sync,k=3', 'kbatch_sync', {}),
      ('kbatch_sync_on_arrival', 'kbatch_sync,k=3,cancel=on_arrival', 'kbatch_sync', {'microbatches': 2}),
      ('kasync', 'kasync,k=2', 'kasync', {}),
      ('kasync_momentum_microbatches', 'kasync,k=1', 'kasync', {'optimizer.momentum': 0.9, 'microbatches': 2}),
      ('kasync_adaptive_lr', 'kasync,k=1,adaptive_lr_c=1e-4,eta_max=0.08', 'kasync', {}),
      ('kbatch_async', 'kbatch_async,k=3', 'kbatch_async', {'microbatches': 2}),
      ('async', 'async', 'kbatch_async', {}),
      ('async_adaptive_lr', 'async,adaptive_lr_c=1e-4', 'kbatch_async', {}),
      ('ringmaster', 'ringmaster,max_delay=2', 'kbatch_async', {}),
      ('ringmaster_adaptive_lr_microbatches', 'async,max_delay=2,adaptive_lr_c=1e-4', 'kbatch_async',
       {'microbatches': 2}),
      ('kbatch_async_max_delay', 'kbatch_async,k=3,max_delay=2', 'kbatch_async', {'optimizer.momentum': 0.9}),
      ('rennala_without_stops', 'kbatch_async,k=3,max_delay=1', 'kbatch_async', {}))
  def test_matches_sequential_parameter_server(self, arg, variant, overrides):
    with jax.enable_x64(True):
      config = _f64(arg, **overrides)
      traj = harness.run_iterations(config, 14, block=2)
    replay(self, traj, config, variant, block=2)
    if config.algorithm.get('max_delay', 0):
      self.assertTrue(any(s.discarded.any() for s in traj.schedules), 'nothing discarded')
      self.assertLess(_staleness(traj), config.algorithm.max_delay)
    if variant in ('kasync', 'kbatch_async') and config.algorithm.get('max_delay', 0) != 1:
      self.assertGreater(_staleness(traj), 0, 'no stale gradient: the test would not exercise views')
    if variant == 'kbatch_async' and config.algorithm.get('k', 1) > 1 and config.algorithm.max_delay != 1:
      several = [(s.contributions > 1) & (s.staleness > 0) for s in traj.schedules]
      self.assertTrue(np.any(several), 'no stale learner pushed twice in one update')

  @parameterized.named_parameters(('ksync', 'ksync', 'ksync'), ('kbatch_async', 'kbatch_async', 'kbatch_async'),
                                  ('kasync', 'kasync', 'kasync'))
  def test_adasync_matches_sequential_parameter_server(self, base, variant):
    with jax.enable_x64(True):
      config = _f64(f'adasync,base={base},k0=1,adapt_every_s=0.01', **{'optimizer.learning_rate': 0.1})
      traj = harness.run_iterations(config, 24, block=1)
    ks = [int(s.k) for s in traj.schedules]
    self.assertEqual(ks[0], 1)
    self.assertGreater(max(ks), 1, 'K never adapted')
    replay(self, traj, config, variant, block=1)

  def test_ksync_with_k_equal_to_workers_is_sync(self):
    with jax.enable_x64(True):
      ksync = harness.run_iterations(_f64(f'ksync,k={P}'), 10, block=5)
      sync = harness.run_iterations(_f64('sync'), 10, block=5)
    for a, b in zip(ksync.params, sync.params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13), a, b)

  def test_kbatch_async_with_k_one_is_async(self):
    with jax.enable_x64(True):
      kbatch = harness.run_iterations(_f64('kbatch_async,k=1'), 10, block=5)
      plain = harness.run_iterations(_f64('async'), 10, block=5)
    for a, b in zip(kbatch.params, plain.params):
      jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)
    self.assertGreater(_staleness(plain), 0)

  def test_ringmaster_without_a_threshold_is_async(self):
    with jax.enable_x64(True):
      ringmaster = harness.run_iterations(_f64('ringmaster,max_delay=1000'), 10, block=5)
      plain = harness.run_iterations(_f64('async'), 10, block=5)
    for a, b in zip(ringmaster.params, plain.params):
      jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)
    self.assertGreater(_staleness(plain), 1)

  def test_ringmaster_learner_discarded_then_pushing_in_the_same_update(self):
    # The case the `discarded` flag exists for: its gradient is computed at W_t, not at its old view.
    with jax.enable_x64(True):
      config = _f64('kbatch_async,k=3,max_delay=1', workers=8, devices=4, microbatches=2)
      traj = harness.run_iterations(config, 12, block=3)
    both = [np.any(s.discarded & (s.contributions > 0)) for s in traj.schedules]
    self.assertTrue(np.any(both), 'no learner was discarded and pushed in one update')
    replay(self, traj, config, 'kbatch_async', block=3)

  def test_workers_on_fewer_devices_give_the_same_trajectory(self):
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64('kbatch_async,k=3', workers=8, devices=d), 6, block=3) for d in (8, 2)]
    for a, b in zip(runs[0].params, runs[1].params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)
    for x, y in zip(jax.tree.leaves(jax.device_get(runs[0].final_state.opt_state)),
                    jax.tree.leaves(jax.device_get(runs[1].final_state.opt_state))):
      np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)

  def test_evaluates_the_server_copy(self):
    traj = harness.run_iterations(harness.synthetic_config('kasync,k=1', **{'stragglers.kind': 'exponential'}), 4)
    spec = traj.run.spec
    consensus = jax.device_get(spec.consensus(traj.final_state.params, traj.final_state.opt_state))
    server = jax.device_get(traj.final_state.opt_state.server)
    jax.tree.map(lambda c, s: np.testing.assert_array_equal(c, s[0]), consensus, server)
    jax.tree.map(lambda s: np.testing.assert_array_equal(s, np.broadcast_to(s[0], s.shape)), server)


class FreshViewsTest(parameterized.TestCase):
  """The synchronous rules declare `fresh_views`: their schedules must have every learner fetch the new model
  (also with a worker lost for good), and then no server copy is kept; the stale variants keep one."""

  @parameterized.parameters(
      ('ksync,k=3', True), ('kbatch_sync,k=3', True), ('adasync,base=ksync,k0=3', True),
      ('adasync,base=kbatch_sync,k0=3', True), ('kasync,k=3', False), ('kbatch_async,k=3', False),
      ('async', False), ('adasync,base=kasync,k0=3', False))
  def test_declared_fresh_views_hold(self, arg, fresh):
    for fail_worker in (-1, 2):
      config = harness.synthetic_config(arg, **{'stragglers.kind': 'exponential',
                                                'stragglers.fail_worker': fail_worker,
                                                'stragglers.fail_at_s': 0.05})
      run = setup.build(config)
      self.assertEqual(run.rule.fresh_views, fresh)
      schedule = setup.clock_for(run, 1e3).next_block(60).schedule
      every_fetch = bool(schedule.refresh_view.all()) and not schedule.fetch_current.any()
      self.assertEqual(every_fetch, fresh, f'{arg} fail_worker={fail_worker}')
      self.assertEqual(setup.init_state(run).opt_state.server is None, fresh)

  @parameterized.parameters('ksync,k=3', 'kbatch_sync,k=3', 'kasync,k=2', 'kbatch_async,k=3', 'async',
                            'async,max_delay=2', 'adasync,base=kbatch_async,k0=2')
  def test_host_total_is_the_pushed_microbatches(self, arg):
    # The divisor the step reads instead of all-reducing a count: K mini-batches of m micro-batches.
    for fail_worker in (-1, 2):
      config = harness.synthetic_config(arg, microbatches=2, **{'stragglers.kind': 'exponential',
                                                                 'stragglers.fail_worker': fail_worker,
                                                                 'stragglers.fail_at_s': 0.05})
      run = setup.build(config)
      schedule = setup.clock_for(run, 1e3).next_block(60).schedule
      np.testing.assert_array_equal(schedule.microbatches_total, schedule.microbatches_done.sum(axis=1))
      np.testing.assert_array_equal(schedule.microbatches_total, 2 * schedule.k)

  def test_fresh_views_require_fresh_learning_rates(self):
    with self.assertRaisesRegex(ValueError, 'staleness-adaptive learning rate needs stale views'):
      parameter_server.parameter_server(optax.sgd(0.1), adaptive_lr_c=1.0, eta_max=0.1, fresh_views=True)


class LibraryAndLoopTest(parameterized.TestCase):

  def test_one_worker_without_schedule_is_the_inner_optimizer_on_the_server(self):
    params = {'w': np.array([1.0, -2.0])}
    grads = {'w': np.array([0.5, 0.25])}
    inner = optax.sgd(0.1, momentum=0.9)
    tx = parameter_server.parameter_server(inner)
    state = tx.init(params)
    got, state = tx.update(grads, state, params)
    want, _ = inner.update(grads, inner.init(params), params)
    # The update moves the view to the new server model: (W + u) - W, exact up to rounding.
    np.testing.assert_allclose(got['w'], want['w'], rtol=1e-5)
    np.testing.assert_allclose(state.server['w'], params['w'] + want['w'], rtol=1e-6)

  def test_staleness_factor(self):
    server, view = {'w': np.array([3.0, 4.0])}, {'w': np.zeros(2)}
    # ||W - view||^2 = 25: eta_j = min(C / 25, eta_max); lambda = eta_j / eta.
    self.assertAlmostEqual(float(parameter_server.staleness_factor(server, view, 0.5, 1.0, 0.1)), 0.2)
    self.assertAlmostEqual(float(parameter_server.staleness_factor(server, view, 50.0, 1.0, 0.1)), 10.0)
    self.assertAlmostEqual(float(parameter_server.staleness_factor(server, server, 0.5, 0.3, 0.1)), 3.0)

  def test_training_loop_logs_k_and_staleness(self):
    config = harness.synthetic_config('kasync,k=2', num_steps=20, log_every=10, eval_every=20, steps_per_call=10,
                                      **{'stragglers.kind': 'exponential'})
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(config, workdir)
      rows = metrics_io.read_rows(workdir)
      self.assertTrue(os.path.exists(os.path.join(workdir, 'summary.json')))
    self.assertLen(rows, 2)
    for row in rows:
      self.assertEqual(row['k'], 2.0)
      self.assertGreater(row['staleness'], 0.0)
      self.assertGreaterEqual(row['max_staleness'], row['staleness'])
    self.assertIn('eval_loss', rows[-1])


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('ksync_zero', 'ksync,k=0', 'algorithm.k=0 .*in 1..4'),
      ('kasync_above_workers', 'kasync,k=5', 'algorithm.k=5 .*in 1..4'),
      ('kbatch_sync_not_int', 'kbatch_sync,k=2.5', "k='2.5' .*must be of type int"),
      ('kbatch_sync_cancel', 'kbatch_sync,cancel=never', "algorithm.cancel='never' .*immediate, on_arrival"),
      ('kbatch_async_negative', 'kbatch_async,k=-1', 'algorithm.k=-1 .*in 1..4'),
      ('adasync_k0', 'adasync,k0=9', 'algorithm.k0=9 .*in 1..4'),
      ('adasync_no_period', 'adasync,adapt_every_s=0', 'algorithm.adapt_every_s=0.0 .*no loss signal'),
      ('adasync_one_block', 'adasync,num_steps=20', 'num_steps=20 .*no loss signal'),
      ('adasync_base', 'adasync,base=sync', "algorithm.base='sync' .*ksync"),
      ('adasync_adaptive_lr_sync_base', 'adasync,adaptive_lr_c=0.1', 'algorithm.adaptive_lr_c=0.1 .*stale'),
      ('adaptive_lr_negative', 'async,adaptive_lr_c=-1.0', 'algorithm.adaptive_lr_c=-1.0'),
      ('max_delay_negative', 'ringmaster,max_delay=-1', 'algorithm.max_delay=-1 .*integer >= 0'),
      ('max_delay_float', 'kbatch_async,max_delay=1.5', "max_delay='1.5' .*must be of type int"),
      ('max_delay_on_kasync', 'kasync,max_delay=2', 'unknown key'),
      ('unknown_field', 'ksync,adaptive_lr_c=1.0', 'unknown key'))
  def test_rejects(self, arg, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      validation.validate(harness.synthetic_config(arg))

  def test_rejects_a_float_k_set_in_code(self):
    config = harness.synthetic_config('kbatch_sync')
    with config.ignore_type():
      config.algorithm.k = 2.0
    with self.assertRaisesRegex(errors.ConfigError, 'algorithm.k=2.0 .*integer in 1..4'):
      validation.validate(config)

  def test_defaults_are_valid(self):
    for name in ('ksync', 'kbatch_sync', 'kasync', 'kbatch_async', 'async', 'ringmaster', 'adasync'):
      validation.validate(harness.synthetic_config(name))
      validation.validate(arguments.apply_arg(harness.synthetic_config(), f'{name}'))

  def test_command_line_error_is_one_line(self):
    out = subprocess.run(
        [sys.executable, '-m', 'waitless.experiments.main', '--config=experiments/configs/digits_stale.py:ksync,k=9',
         '--workdir=/nonexistent/never_created'], capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(out.returncode, 2, out.stderr)
    self.assertIn('error: algorithm.k=9 is not allowed: must be an integer in 1..8 (workers)', out.stderr)
    self.assertNotIn('Traceback', out.stderr)


if __name__ == '__main__':
  absltest.main()
