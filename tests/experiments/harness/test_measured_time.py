"""Measured time (`stragglers.kind='measured'`, harness/measured_time.py): validation, schedules, real runs."""

from __future__ import annotations

import json
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.harness import measured_speeds
from waitless.cluster import registry
from waitless.experiments.configs import digits
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from tests.experiments.harness import test_multiprocess

SMALL = 'stragglers.kind=measured,workers=2,devices=2,microbatches=4'


def _config(name: str, **overrides):
  config = digits.get_config(f'{name},{SMALL}')
  for key, value in overrides.items():
    config[key] = value
  return config


class ValidationTest(parameterized.TestCase):

  def test_every_algorithm_is_allowed_or_refused(self):
    for name in registry.names():
      self.assertNotEqual(name in measured_time.ALLOWED, name in measured_time.REFUSED, name)

  @parameterized.parameters(*measured_time.REFUSED)
  def test_rules_that_need_simulated_events_are_refused_in_one_line(self, name):
    with self.assertRaises(errors.ConfigError) as e:
      validation.validate(_config(name))
    message = str(e.exception)
    self.assertNotIn('\n', message)
    self.assertStartsWith(message, "stragglers.kind='measured' is not allowed: ")
    self.assertIn('simulated', message)
    self.assertIn('allowed: sync, local_sgd', message)

  @parameterized.parameters(*[n for n in measured_time.ALLOWED if n not in ('lap_sgd', 'lpp_sgd')])
  def test_synchronous_rules_and_nonblocking_are_allowed(self, name):
    validation.validate(_config(name))

  def test_lap_needs_an_explicit_delay(self):
    with self.assertRaisesRegex(errors.ConfigError, r'^algorithm.delay=None is not allowed: .*simulated network'):
      validation.validate(_config('lap_sgd'))
    validation.validate(digits.get_config(f'lap_sgd,delay=1,{SMALL}'))

  @parameterized.parameters(('stragglers.slow_fraction=0.5', 'stragglers.slow_fraction'),
                            ('stragglers.worker_factors=(1.0,2.0)', 'stragglers.worker_factors'),
                            ('stragglers.fail_worker=1', 'stragglers.fail_worker'),
                            ('stragglers.calibrate=True', 'stragglers.calibrate'),
                            ('network.kind=alpha_beta', 'network.kind'))
  def test_simulated_modifiers_are_refused(self, override, field):
    with self.assertRaisesRegex(errors.ConfigError, rf'^{field}=.* is not allowed: .*'):
      validation.validate(digits.get_config(f'sync,{SMALL},{override}'))

  @parameterized.parameters('sync', 'local_sgd', 'diloco', 'streaming_diloco', 'dasgd', 'dpsgd', 'matcha', 'wagma')
  def test_synchronous_schedules_every_worker_all_microbatches(self, name):
    config = digits.get_config(f'{name},stragglers.kind=measured,workers=4,devices=2,microbatches=2')
    run = setup.build(config)
    clock = measured_time.MeasuredClock(run.config, run.rule, 1e4, devices=2)
    block = clock.next_block(8)
    np.testing.assert_array_equal(block.schedule.microbatches_done, np.full((8, 4), 2))
    if name == 'wagma':
      self.assertTrue(np.all(block.schedule.fresh))

  def test_simulate_refuses_a_measured_config(self):
    from waitless.experiments import simulate
    with self.assertRaisesRegex(errors.ConfigError, r"^stragglers.kind='measured' is not allowed: .*no simulated"):
      simulate.simulate(_config('sync'), iterations=10)

  def test_a_sim_time_budget_is_refused(self):
    from waitless.experiments.comparison import plan as compare_plan
    with self.assertRaisesRegex(errors.ConfigError, r"stragglers.kind='measured' is not allowed: .*--sim_time"):
      compare_plan.plan(digits.get_config, [f'sync,{SMALL}'], [()], seeds=1, root=self.create_tempdir().full_path,
                        sim_time=1.0)

  def test_block_seconds_leave_compilation_out(self):
    self.assertAlmostEqual(measured_time.block_seconds(0.5, 10.0, 13.0, False, np.array([2.0])), 3.5)
    self.assertAlmostEqual(measured_time.block_seconds(0.5, 10.0, 13.0, True, np.array([2.5, 2.0])), 1.5)

  def test_main_refuses_a_bad_slowdown_in_one_line_with_status_2(self):
    workdir = self.create_tempdir().full_path
    result = test_multiprocess._main([f'--config=experiments/configs/digits.py:sync,{SMALL}',
                                      f'--workdir={workdir}', '--debug_slow_process=5:1'], timeout=120)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertRegex(result.stderr.strip().splitlines()[-1], r'^error: debug_slow_process=.* must be "I:S"')


def _counting_hook(calls):
  """A loss hook that counts the micro-batch losses computed (one host callback each)."""
  def count(loss):
    calls.append(1)
    return np.zeros(np.shape(loss), np.asarray(loss).dtype)

  def hook(loss):
    return loss + jax.pure_callback(count, jax.ShapeDtypeStruct(loss.shape, loss.dtype),
                                    jax.lax.stop_gradient(loss), vmap_method='sequential')
  return hook


class MeasuredRunTest(absltest.TestCase):

  def test_a_measured_sync_run_trains_on_measured_time(self):
    config = _config('sync', num_steps=40, eval_every=20, log_every=10, checkpoint_every=40)
    workdir = self.create_tempdir().full_path
    summary = train.train_and_evaluate(config, workdir)
    rows = metrics_io.read_rows(workdir)
    self.assertEqual(summary['clock'], 'measured')
    self.assertTrue(all('sim_time' not in r for r in rows))  # one time field, named after its clock
    times = [r['measured_time'] for r in rows]
    self.assertTrue(all(0 < a < b for a, b in zip(times, times[1:])), times)
    self.assertLess(times[-1], summary['wall_time'])  # compilation and evaluation left out
    self.assertEqual(summary['measured_time'], times[-1])
    self.assertGreater(summary['final_eval_accuracy'], 0.8)
    for row in rows:
      self.assertEqual(row['microbatches_done'], [4.0, 4.0])
      self.assertGreater(row['compute_s'], 0)
      self.assertTrue(0 <= row['idle_fraction'] < 1)
    self.assertLen(summary['measured_seconds_per_microbatch'], 2)
    with open(os.path.join(workdir, 'summary.json')) as f:
      self.assertEqual(json.load(f)['clock'], 'measured')

  def test_nonblocking_runs_the_counts_measured_speeds_gives_for_what_it_was_fed(self):
    """The device times are injected (device 1 four times slower per micro-batch, 1 ms per call): the counts
    that ran must be `MeasuredSpeeds.counts()` of exactly those measurements, and the step must have computed
    exactly those micro-batches (one loss callback each)."""
    config = _config('nonblocking', num_steps=24, eval_every=12, log_every=4, checkpoint_every=24,
                     steps_per_call=4)
    used, calls = [], []
    record = measured_time.MeasuredClock.record

    def injected(clock, block, compute_s, seconds):
      done = np.asarray(block.schedule.microbatches_done)
      used.append(done.copy())
      return record(clock, block, 0.001 + done * np.array([0.001, 0.004]), seconds)

    with mock.patch.object(measured_time.MeasuredClock, 'record', injected):
      train.train_and_evaluate(config, self.create_tempdir().full_path, loss_hook=_counting_hook(calls))
    speeds = measured_speeds.MeasuredSpeeds(2, 4, probe=(4, 1))
    first = True
    for done in used:
      np.testing.assert_array_equal(done, np.broadcast_to(speeds.counts(), done.shape))
      for row in done:
        if not first:
          speeds.observe_calls(row, 0.001 + row * np.array([0.001, 0.004]))
        first = False
    self.assertEqual([len(d) for d in used[:3]], [1, 1, 1])  # the unfed first iteration, then the probe
    np.testing.assert_array_equal(used[-1][-1], [4, 1])   # deadline 5 ms: device 1 fits one micro-batch
    self.assertEqual(sum(int(d.sum()) for d in used), len(calls))  # the loop ran only those micro-batches
    self.assertLess(len(calls), 24 * 2 * 4)

  def test_a_stopped_measured_run_resumes_and_its_clock_goes_on(self):
    config = _config('nonblocking', num_steps=20, eval_every=10, log_every=5, checkpoint_every=10,
                     steps_per_call=5)
    workdir = self.create_tempdir().full_path

    class StopAt(preemption.StopRequests):
      def agreed(self, step, checkpoint_due=False):
        if step >= 8:
          self.request('test')
        return super().agreed(step, checkpoint_due)

    with self.assertRaises(preemption.Preempted):
      train.train_and_evaluate(config, workdir, stop_requests=StopAt())
    before = metrics_io.read_rows(workdir)
    summary = train.train_and_evaluate(config, workdir)
    rows = metrics_io.read_rows(workdir)
    self.assertEqual(summary['steps'], 20)
    self.assertEqual([r['step'] for r in rows], [5, 10, 15, 20])
    self.assertEqual(rows[:len(before)], before)
    self.assertGreater(summary['measured_time'], before[-1]['measured_time'])
    # Stopped after the block 10..15; re-probed after the resume: step 17 ran 1 micro-batch on every device.
    self.assertEqual(before[-1]['step'], 15)
    self.assertTrue(all(c < 4 for c in rows[-1]['microbatches_done']), rows[-1])


class TwoProcessTest(absltest.TestCase):
  """About 25 s on 2 CPU cores: under the ~60 s that would make it `slow`."""

  def test_the_slowed_process_runs_fewer_microbatches(self):
    workdir = self.create_tempdir().full_path
    result = test_multiprocess._launch(2, [
        f'--config=experiments/configs/digits.py:nonblocking,{SMALL},num_steps=40,eval_every=20,log_every=10',
        f'--workdir={workdir}', '--debug_slow_process=1:0.004'], timeout=300)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    rows = metrics_io.read_rows(workdir)
    fast, slow = rows[-1]['microbatches_done']
    self.assertEqual(fast, 4.0)
    self.assertLess(slow, fast)
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
    seconds = summary['measured_seconds_per_microbatch']
    self.assertGreater(seconds[1], 0.003)  # the 4 ms sleep, measured on process 1's device
    # Process 0's device is timed without its wait for process 1 at the all-reduce (about 0.25 ms per
    # micro-batch here; 4.5 ms when the clock read slipped past the all-reduce).
    self.assertLess(seconds[0], 0.002)


if __name__ == '__main__':
  absltest.main()
