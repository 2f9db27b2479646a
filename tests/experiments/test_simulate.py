"""`python -m waitless.experiments.simulate`: the cluster simulator alone, driven by an algorithm's own time rule."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from waitless import config_errors as errors
from waitless import machine
from waitless.cluster import factory as cluster_factory
from waitless.cluster import registry
from waitless.data import registry as data_registry
from waitless.experiments import simulate
from waitless.experiments.configs import digits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SimulateTest(parameterized.TestCase):

  def test_sync_without_stragglers(self):
    result = simulate.simulate(digits.get_config('sync'), iterations=120, nbytes=1000.0, block=50)
    self.assertEqual(result['iterations'], 120)
    self.assertEqual(result['rule'], 'Barrier')
    self.assertAlmostEqual(result['mean_iteration_time'], 0.01)
    self.assertEqual(result['mean_staleness'], 0.0)
    self.assertEqual(result['idle_fraction'], 0.0)
    self.assertAlmostEqual(result['bytes_per_iteration'], 2 * 7 * 1000.0)

  def test_every_registered_algorithm_runs_its_own_rule(self):
    for name in registry.names():
      config = digits.get_config(f'{name},stragglers.kind=exponential,network.kind=alpha_beta')
      result = simulate.simulate(config, iterations=50, nbytes=1e5)
      self.assertEqual(result['algorithm'], name)
      self.assertGreater(result['mean_iteration_time'], 0, name)
      self.assertLessEqual(result['idle_fraction'], 1.0, name)
      self.assertGreaterEqual(result['idle_fraction'], 0.0, name)

  def test_every_registered_algorithm_on_a_profile_pays_its_host_time(self):
    # host time > 0 runs every rule one iteration at a time (the vectorised ones too): each still runs, and no
    # iteration is shorter than the host's work (`clock.py` charges it after every iteration).
    for name in registry.names():
      config = digits.get_config(f'{name},stragglers.kind=exponential,cluster.profile=commodity_10gbe')
      result = simulate.simulate(config, iterations=30, nbytes=1e5)
      self.assertEqual(result['host_s'], 2e-4, name)
      self.assertGreaterEqual(result['mean_iteration_time'], 2e-4, name)
      self.assertLess(result['mean_iteration_time'], 1.0, name)

  @parameterized.parameters(('ksync,k=1', 'KSync'), ('kbatch_sync,k=2', 'KBatchSync'), ('sync', 'KSync'))
  def test_a_ray_config_predicts_what_the_ray_server_does(self, arg, rule):
    # On Ray a late job runs to its end and is discarded on arrival (`ray_config.server_config`): its prediction
    # is that rule's, not the paper's cancellation.
    pairs = 'workers=2,devices=2,stragglers.kind=exponential,network.kind=alpha_beta'
    ray = simulate.simulate(digits.get_config(f'{arg},runtime=ray,{pairs}'), iterations=200, nbytes=1e6)
    name, k = (arg.split(',') + ['k=2'])[:2]
    name = 'ksync' if name == 'sync' else name
    arrival = simulate.simulate(digits.get_config(f'{name},{k},cancel=on_arrival,{pairs}'), iterations=200,
                                nbytes=1e6)
    immediate = simulate.simulate(digits.get_config(f'{name},{k},{pairs}'), iterations=200, nbytes=1e6)
    self.assertEqual(ray['rule'], rule)
    self.assertEqual(ray['mean_iteration_time'], arrival['mean_iteration_time'])
    if arg != 'sync':  # K = P: nothing is late, the two rules agree
      self.assertNotEqual(ray['mean_iteration_time'], immediate['mean_iteration_time'])

  def test_stragglers_make_sync_wait(self):
    config = digits.get_config('sync,stragglers.kind=slow_workers,stragglers.slow_workers=[0]')
    result = simulate.simulate(config, iterations=10, nbytes=0.0)
    self.assertAlmostEqual(result['mean_iteration_time'], 0.02)
    self.assertAlmostEqual(result['idle_fraction'], 7 / 16)
    self.assertEqual(result['idle_fraction_per_worker'][0], 0.0)

  def test_a_duration_in_epochs_simulates_its_iterations(self):
    config = digits.get_config('sync,num_epochs=1')
    size = data_registry.make_dataset(config).train_size
    result = simulate.simulate(config)
    self.assertEqual(result['iterations'], -(-size // (config.workers * config.batch_size)))

  def test_model_bytes_from_shapes(self):
    # digits MLP 64 -> 128 -> 10, float32.
    self.assertEqual(simulate.model_bytes(digits.get_config('sync')), 4.0 * (64 * 128 + 128 + 128 * 10 + 10))

  def test_bad_config_is_a_config_error(self):
    config = digits.get_config('sync,stragglers.kind=exponential,stragglers.rate=-2.0')
    with self.assertRaisesRegex(errors.ConfigError, 'stragglers.rate'):
      simulate.simulate(config, iterations=5, nbytes=1.0)


class LimitsTest(parameterized.TestCase):
  """Issue 59: simulate validated less than main (tracebacks, another field named) and had no upper bound on
  workers (imagenet sync at 2^30 workers grew until killed; WAGMA at 32,768 built an 8.6 GB P x P table)."""

  @parameterized.named_parameters(
      ('zero_workers', 'sync,workers=0', 'workers=0 is not allowed: must be an integer >= 1'),
      ('negative_workers', 'sync,workers=-1', 'workers=-1 is not allowed: must be an integer >= 1'),
      ('zero_devices', 'sync,devices=0', 'devices=0 is not allowed: must be an integer >= 1'),
      ('not_a_multiple', 'sync,workers=8,devices=3', 'workers=8 is not allowed: must be a multiple of devices=3'),
      ('wagma_zero_workers', 'wagma,workers=0', 'workers=0 is not allowed'))
  def test_the_layout_is_checked_as_main_checks_it(self, arg, message):
    with self.assertRaisesRegex(errors.ConfigError, f'^{re.escape(message)}'):
      simulate.simulate(digits.get_config(arg), iterations=5, nbytes=1.0)

  def test_a_clock_larger_than_the_memory_is_refused_before_it_is_built(self):
    config = digits.get_config('sync,workers=1073741824,devices=1')
    with mock.patch.object(machine, 'available_memory_bytes', return_value=16 * 10**9), \
         mock.patch.object(cluster_factory, 'validate', side_effect=AssertionError('built')):
      with self.assertRaisesRegex(errors.ConfigError, r'^workers=1073741824 is not allowed: the simulated clock of '
                                  r'1073741824 workers .* needs about .* GB, more than .* \(16 GB available\)'):
        simulate.simulate(config, iterations=5, nbytes=1.0)
    config = digits.get_config('wagma,workers=65536,devices=1')
    with mock.patch.object(machine, 'available_memory_bytes', return_value=4 * 10**9), \
         mock.patch.object(cluster_factory, 'validate', side_effect=AssertionError('built')):
      with self.assertRaisesRegex(errors.ConfigError, '^--block=1000 is not allowed: .* or a smaller --block'):
        simulate.simulate(config, iterations=2000, nbytes=1.0)

  def test_wagma_at_32768_workers_fits_in_a_few_hundred_megabytes(self):
    result = simulate.simulate(digits.get_config('wagma,workers=32768,devices=1'), iterations=20, nbytes=1.0,
                               block=10)
    self.assertEqual((result['workers'], result['iterations']), (32768, 20))


class CommandLineTest(parameterized.TestCase):

  def _run(self, *args):
    return subprocess.run([sys.executable, '-m', 'waitless.experiments.simulate', *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)

  def test_a_signal_is_one_line(self):
    # Issue 59's principle: Ctrl-C and SIGTERM are one line (a KeyboardInterrupt traceback, a silent 143 before).
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
      process = subprocess.Popen([sys.executable, '-m', 'waitless.experiments.simulate',
                                  '--config=experiments/configs/digits.py:wagma,workers=1024,devices=1',
                                  '--iterations=100000000', '--model_bytes=1'], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
      time.sleep(8)  # past its imports: simulating
      process.send_signal(sig)
      out, err = process.communicate(timeout=60)
      self.assertEqual(process.returncode, status, err[-2000:])
      self.assertEqual((out, err), ('', f'stopped by {sig.name}: nothing simulated is printed; rerun to simulate\n'))

  def test_prints_one_json_object(self):
    out = self._run('--config=experiments/configs/digits.py:local_sgd', '--iterations=40')
    self.assertEqual(out.returncode, 0, out.stderr)
    result = json.loads(out.stdout)
    for key in ('mean_iteration_time', 'iterations', 'mean_staleness', 'idle_fraction', 'bytes_communicated'):
      self.assertIn(key, result)
    self.assertEqual(result['iterations'], 40)
    self.assertEqual(result['model_bytes'], 38440.0)

  def test_config_error_names_the_field(self):
    out = self._run('--config=experiments/configs/digits.py:sync', '--config.stragglers.slow_fraction=2.0',
                    '--iterations=5', '--model_bytes=10')
    self.assertEqual(out.returncode, 2)
    self.assertIn('stragglers.slow_fraction=2.0 is not allowed', out.stderr)
    self.assertNotIn('Traceback', out.stderr)

  def test_profile_by_name_and_an_explicit_flag_over_it(self):
    out = self._run('--config=experiments/configs/digits.py:sync', '--config.cluster.profile=commodity_10gbe',
                    '--config.cluster.host_s=0.5', '--iterations=5', '--model_bytes=1000')
    self.assertEqual(out.returncode, 0, out.stderr)
    result = json.loads(out.stdout)
    self.assertEqual((result['profile'], result['network'], result['host_s']), ('commodity_10gbe', 'profile', 0.5))
    self.assertGreater(result['mean_iteration_time'], 0.5)

  def test_unknown_profile_is_one_line_with_the_names(self):
    out = self._run('--config=experiments/configs/digits.py:sync', '--config.cluster.profile=nowhere',
                    '--iterations=5', '--model_bytes=10')
    self.assertEqual(out.returncode, 2)
    self.assertRegex(out.stderr, r"cluster\.profile='nowhere' is not allowed: unknown profile; shipped: .*dgx_h100")
    self.assertNotIn('Traceback', out.stderr)

  @parameterized.named_parameters(
      ('not_a_number', ['--config=experiments/configs/digits.py:sync', '--config.optimizer.learning_rate=abc'],
       'learning_rate'),
      ('unknown_key', ['--config=experiments/configs/digits.py:sync,nosuch=1'], 'nosuch'),
      ('unknown_algorithm', ['--config=experiments/configs/digits.py:nosuch'], 'algorithm.name'),
      ('infinite_rate', ['--config=experiments/configs/digits.py:sync,stragglers.rate=inf'], 'stragglers.rate'))
  def test_a_bad_config_argument_is_one_line_and_status_2(self, args, field):
    # Issue 39: simulate printed absl's traceback and "FATAL Flags parsing error", exit 1, where main and compare
    # give one line.
    out = self._run(*args, '--iterations=5', '--model_bytes=10')
    self.assertEqual(out.returncode, 2, out.stderr)
    lines = out.stderr.strip().splitlines()
    self.assertLen(lines, 1, out.stderr)
    self.assertRegex(lines[0], f'^error: .*{field}')


if __name__ == '__main__':
  absltest.main()
