"""Replicas: several runs in one compiled program give each run the trajectory and the files it has alone."""

import os
import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.experiments.configs import digits
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import replicas
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from tests import harness
from tests.experiments.harness import test_preemption
from tests.experiments import test_train

# CI runs these (one per kind of state and schedule); the rest of the registry is marked slow.
REPRESENTATIVE = ('sync', 'diloco', 'streaming_diloco', 'kasync', 'adasync', 'nonblocking', 'wagma')
# Options that change an algorithm's rule, also in CI: (test name, config arg).
REPRESENTATIVE_OPTIONS = (('wagma_step_then_average', 'wagma,rule=step_then_average'),)


def _f64(name, seed, learning_rate, momentum, **overrides):
  """The registry test's general layout (4 workers on 2 devices, 2 micro-batches), in float64."""
  return harness.synthetic_config(name, workers=4, devices=2, microbatches=2, seed=seed, **{
      'model.param_dtype': 'float64', 'model.dtype': 'float64', 'optimizer.learning_rate': learning_rate,
      'optimizer.momentum': momentum, **overrides})


def _other_values(name):
  """A second value for each algorithm field the spec lets replicas differ in (0 where 0 switches a term off)."""
  spec = registry.get(name.split(',')[0])
  config = harness.synthetic_config(name)
  return {f'algorithm.{f}': 0.0 if 'momentum' in f else 0.5 * config.algorithm[f] for f in spec.hyperparameters}


def _assert_each_replica_equals_its_run_alone(test, name):
  with jax.enable_x64(True):
    configs = [_f64(name, 0, 0.05, 0.9), _f64(name, 1, 0.03, 0.0, **_other_values(name)),
               _f64(name, 0, 0.03, 0.9)]
    group = harness.run_group_iterations(configs, 6, block=3)
    for config, params in zip(configs, group):
      alone = harness.run_iterations(config, 6, block=3).params[-1]
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), params, alone)
    # The replicas really differ: the test would pass vacuously if every replica ran replica 0.
    test.assertGreater(np.abs(np.asarray(jax.tree.leaves(group[0])[0])
                              - np.asarray(jax.tree.leaves(group[2])[0])).max(), 1e-6)


class ReplicaExactnessTest(parameterized.TestCase):
  """Three replicas (two seeds, two learning rates, momentum 0.9 and 0, the spec's hyper-parameters) against
  each run alone, 6 iterations in blocks of 3, float64: every registered algorithm."""

  @parameterized.named_parameters(*[(name, name) for name in REPRESENTATIVE], *REPRESENTATIVE_OPTIONS)
  def test_each_replica_equals_its_run_alone_in_float64(self, name):
    _assert_each_replica_equals_its_run_alone(self, name)

  @parameterized.named_parameters(*[(name, name) for name in registry.names() if name not in REPRESENTATIVE])
  @pytest.mark.slow
  def test_each_replica_equals_its_run_alone_in_float64_rest(self, name):
    _assert_each_replica_equals_its_run_alone(self, name)

  def test_first_steps_agree_to_rounding_in_float32(self):
    configs = []
    for seed, lr in ((0, 0.05), (1, 0.1)):
      config = digits.get_config('local_sgd,local_steps=2')
      config.seed, config.optimizer.learning_rate = seed, lr
      configs.append(config)
    group = harness.run_group_iterations(configs, 4, block=2)
    for config, params in zip(configs, group):
      alone = harness.run_iterations(config, 4, block=2).params[-1]
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), params, alone)


class TrainGroupTest(parameterized.TestCase):

  def _configs(self, **overrides):
    """Two seeds and two learning rates of K-async (a vectorised clock, stale views), the second run shorter."""
    out = []
    for seed, lr, steps in ((0, 0.05, 40), (1, 0.03, 30)):
      out.append(harness.synthetic_config('kasync,k=2', num_steps=steps, checkpoint_every=10, log_every=5,
                                          eval_every=10, steps_per_call=4, seed=seed,
                                          **{'optimizer.learning_rate': lr, **overrides}))
    return out

  def test_each_replica_writes_the_files_and_rows_of_its_run_alone(self):
    with jax.enable_x64(True):
      configs = self._configs(**{'model.param_dtype': 'float64', 'model.dtype': 'float64'})
      root = self.create_tempdir().full_path
      workdirs = [os.path.join(root, f'r{i}') for i in range(2)]
      outcomes = train.train_group(configs, workdirs)
      for config, workdir, summary in zip(configs, workdirs, outcomes):
        alone = self.create_tempdir().full_path
        expected = train.train_and_evaluate(config, alone)
        for name in ('metrics.jsonl', 'summary.json', 'config.json', 'checkpoints', 'tensorboard'):
          self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
        self.assertEqual(summary['steps'], config.num_steps)  # the shorter run stopped at its own budget
        self.assertEqual(summary['replicas'], 2)
        self.assertEqual(expected['replicas'], 1)
        self.assertEqual(summary['sim_time'], expected['sim_time'])  # the host clock: exactly
        np.testing.assert_allclose(summary['param_norm'], expected['param_norm'], rtol=1e-10)
        rows, rows_alone = metrics_io.read_rows(workdir), metrics_io.read_rows(alone)
        self.assertEqual([r['step'] for r in rows], [r['step'] for r in rows_alone])
        self.assertEqual([r['sim_time'] for r in rows], [r['sim_time'] for r in rows_alone])
        np.testing.assert_allclose([r['train_loss'] for r in rows], [r['train_loss'] for r in rows_alone],
                                   rtol=1e-10)
        self.assertEqual(replicas.saved_steps(workdir)[-1], config.num_steps)

  def test_a_stopped_group_resumes_to_the_rows_of_an_uninterrupted_one(self):
    configs = self._configs()
    root = self.create_tempdir().full_path
    full = [os.path.join(root, 'full', f'r{i}') for i in range(2)]
    stopped = [os.path.join(root, 'stopped', f'r{i}') for i in range(2)]
    train.train_group(configs, full)
    with self.assertRaisesRegex(preemption.Preempted, 'at step 15'):
      train.train_group(configs, stopped, stop_requests=test_preemption.StopAt(11))
    for workdir in stopped:
      self.assertEqual(replicas.saved_steps(workdir)[-1], 15)
      self.assertFalse(os.path.exists(os.path.join(workdir, 'summary.json')))
    train.train_group(configs, stopped)
    for a, b in zip(full, stopped):
      self.assertEqual(test_train._summary_without_wall(a), test_train._summary_without_wall(b))
      self.assertEqual(test_train._strip_wall(metrics_io.read_rows(a)), test_train._strip_wall(metrics_io.read_rows(b)))

  def test_a_rerun_over_finished_replicas_keeps_their_summaries(self):
    # Issue 39: `main --seeds=3` rerun over finished seeds rewrote their wall_time.
    configs = self._configs()
    root = self.create_tempdir().full_path
    workdirs = [os.path.join(root, f'r{i}') for i in range(2)]
    first = train.train_group(configs, workdirs)
    written = [open(os.path.join(w, 'summary.json')).read() for w in workdirs]
    time.sleep(0.05)
    again = train.train_group(configs, workdirs)
    self.assertEqual([open(os.path.join(w, 'summary.json')).read() for w in workdirs], written)
    self.assertEqual([s['wall_time'] for s in again], [s['wall_time'] for s in first])
    configs[0].optimizer.learning_rate = 0.5  # another run in a finished workdir is still refused
    with self.assertRaisesRegex(train.workdir_lib.WorkdirConflict, 'optimizer'):
      train.train_group(configs, workdirs)

  def test_a_replica_a_checkpoint_ahead_goes_back_to_the_common_one(self):
    # A kill between the replicas' saves leaves one of them a checkpoint ahead: the group resumes from the step
    # both have, and the runs end as an uninterrupted group's.
    configs = self._configs()
    root = self.create_tempdir().full_path
    full = [os.path.join(root, 'full', f'r{i}') for i in range(2)]
    killed = [os.path.join(root, 'killed', f'r{i}') for i in range(2)]
    train.train_group(configs, full)
    with self.assertRaises(preemption.Preempted):
      train.train_group(configs, killed, stop_requests=test_preemption.StopAt(21))  # checkpoints 10, 20, 25
    os.rename(os.path.join(killed[1], 'checkpoints', '25'), os.path.join(root, 'lost'))
    train.train_group(configs, killed)
    for a, b in zip(full, killed):
      self.assertEqual(test_train._summary_without_wall(a), test_train._summary_without_wall(b))
      self.assertEqual(test_train._strip_wall(metrics_io.read_rows(a)), test_train._strip_wall(metrics_io.read_rows(b)))

  def test_a_diverged_replica_stops_and_the_others_go_on(self):
    configs = self._configs()
    configs[0].optimizer.learning_rate = 1e6
    root = self.create_tempdir().full_path
    with self.assertLogs('waitless', level='INFO') as logs:
      outcomes = train.train_group(configs, [os.path.join(root, f'r{i}') for i in range(2)])
    self.assertIsInstance(outcomes[0], recorder_lib.TrainingDiverged)
    # Reported once, at its first non-finite step: the block dispatched ahead of the divergence is not read.
    reports = [line for line in logs.output if 'training loss is' in line]
    self.assertEqual(reports, [f'INFO:waitless:{outcomes[0]}'])
    self.assertEqual(outcomes[1]['steps'], 30)
    self.assertFalse(os.path.exists(os.path.join(root, 'r0', 'summary.json')))


class MainSeedsTest(absltest.TestCase):

  def test_seeds_train_in_one_program_each_in_its_own_workdir(self):
    workdir = self.create_tempdir().full_path
    result = test_train._main(['--config=experiments/configs/digits.py:sync,num_steps=20,eval_every=10',
                               f'--workdir={workdir}', '--seeds=2'], timeout=600)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn('2 runs in one program', result.stderr)
    for seed in (0, 1):
      summary = test_train._summary_without_wall(os.path.join(workdir, f'seed{seed}'))
      self.assertEqual((summary['steps'], summary['replicas']), (20, 2))
    self.assertNotEqual(metrics_io.read_rows(os.path.join(workdir, 'seed0'))[-1]['train_loss'],
                        metrics_io.read_rows(os.path.join(workdir, 'seed1'))[-1]['train_loss'])

  def test_bad_seeds_and_max_replicas_are_one_line_and_exit_2(self):
    for flags, message in ((['--seeds=0'], '--seeds=0 is not allowed'),
                           (['--seeds=2', '--max_replicas=0'], '--max_replicas=0 is not allowed')):
      workdir = self.create_tempdir().full_path
      result = test_train._main(['--config=experiments/configs/digits.py:sync', f'--workdir={workdir}', *flags],
                                timeout=300)
      self.assertEqual(result.returncode, 2, result.stderr)
      lines = [line for line in result.stderr.splitlines() if line.strip()]
      self.assertLen(lines, 1, result.stderr)
      self.assertRegex(lines[0], '^error: ' + message)
      self.assertEqual(os.listdir(workdir), [])  # nothing written


class PartitionTest(parameterized.TestCase):

  def _config(self, arg='sync', **fields):
    config = digits.get_config(arg)
    for key, value in fields.items():
      replicas.set_path(config, key, value)
    return config

  def test_seeds_and_scalar_hyperparameters_share_a_program_and_shapes_do_not(self):
    configs = [self._config(seed=0), self._config(seed=1), self._config(**{'optimizer.learning_rate': 0.5}),
               self._config(workers=4), self._config('ksync,k=2'), self._config('ksync,k=4'),
               self._config(num_steps=20), self._config(**{'stragglers.calibrate': True}),
               self._config(**{'optimizer.momentum': 0.0})]
    root = self.create_tempdir().full_path
    groups = replicas.partition(configs, [os.path.join(root, str(i)) for i in range(len(configs))])
    self.assertEqual(groups, [[0, 1, 2, 6, 8], [3], [4], [5], [7]])

  def test_the_step_lr_schedule_keeps_num_steps_a_constant(self):
    step = dict(**{'optimizer.lr_schedule': 'step'})
    configs = [self._config(**step), self._config(num_steps=20, **step), self._config(seed=3, **step)]
    groups = replicas.partition(configs, ['/a', '/b', '/c'])
    self.assertEqual(groups, [[0, 2], [1]])

  def test_runs_with_different_latest_checkpoints_are_separate_groups_and_a_limit_splits(self):
    root = self.create_tempdir().full_path
    workdirs = [os.path.join(root, str(i)) for i in range(5)]
    os.makedirs(os.path.join(workdirs[3], 'checkpoints', '100'))
    configs = [self._config(seed=i) for i in range(5)]
    self.assertEqual(replicas.partition(configs, workdirs), [[0, 1, 2, 4], [3]])
    self.assertEqual(replicas.partition(configs, workdirs, lambda c: 2), [[0, 1], [2, 4], [3]])

  def test_what_differs_is_an_input_and_what_is_shared_a_constant(self):
    configs = [self._config(seed=0), self._config(seed=1, **{'optimizer.learning_rate': 0.5})]
    values = replicas.varying_values(configs)
    self.assertEqual(sorted(values), ['optimizer.learning_rate', 'seed'])
    np.testing.assert_array_equal(values['seed'], [0, 1])

  def test_more_replicas_than_fit_is_one_line_naming_the_flag(self):
    configs = [self._config(seed=i) for i in range(4)]
    with self.assertRaisesRegex(errors.ConfigError, r'^--max_replicas=4 is not allowed: only 1 replicas'):
      with absltest.mock.patch.object(replicas, 'available_memory_bytes', return_value=1):
        setup.plan_groups(configs, [f'/w{i}' for i in range(4)], max_replicas=4)
    with absltest.mock.patch.object(replicas, 'available_memory_bytes', return_value=1):
      planned = setup.plan_groups(configs, [f'/w{i}' for i in range(4)])
    self.assertEqual([group.indices for group in planned], [[0], [1], [2], [3]])
    # The run built to size the program is handed on, not built again: the first seed's.
    self.assertEqual([[run is not None for run in group.built] for group in planned], [[True], [False], [False],
                                                                                         [False]])
    self.assertIs(planned[0].built[0].config, configs[0])
    with self.assertRaisesRegex(errors.ConfigError, r'^--max_replicas=0 is not allowed'):
      setup.plan_groups(configs, [f'/w{i}' for i in range(4)], max_replicas=0)


if __name__ == '__main__':
  absltest.main()
