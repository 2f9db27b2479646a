"""`benchmarks/real_run.py` without starting processes: the figures it reads from a measured run's files (times
to target accuracy and loss interpolated as `experiments.compare` does), the median over rounds with missed
targets, the default target loss, the report, and bad flags refused before any run starts."""

import json
import os
import types

import numpy as np

from absl.testing import absltest
from absl.testing import parameterized
from unittest import mock

from benchmarks import real_run
from benchmarks import real_stragglers


def _write_run(workdir, rows, summary):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in rows))
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f)


# A measured run's rows every 10 steps, evaluated at each: 20 ms per iteration after a slow first row.
ROWS = [
    {'step': 10, 'measured_time': 0.5, 'eval_accuracy': 0.5, 'eval_loss': 1.5, 'microbatches_done': [4, 1]},
    {'step': 20, 'measured_time': 0.7, 'eval_accuracy': 0.9, 'eval_loss': 0.5, 'microbatches_done': [4, 1]},
    {'step': 30, 'measured_time': 0.9, 'eval_accuracy': 0.98, 'eval_loss': 0.3, 'microbatches_done': [4, 2]},
]
SUMMARY = {'final_eval_accuracy': 0.98, 'measured_time': 0.9, 'wall_time': 3.0, 'num_params': 100,
           'measured_seconds_per_microbatch': [0.001, 0.004], 'measured_overhead_s': [0.0, 0.0005]}


class FiguresTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.create_tempdir().full_path
    _write_run(self.workdir, ROWS, SUMMARY)

  def test_times_to_target_are_interpolated_between_evaluations(self):
    figures = real_run.figures(self.workdir, target_accuracy=0.95)
    self.assertEqual((figures['first_step'], figures['first_time']), (10.0, 0.5))  # the warm-up row
    # 0.95 lies 5/8 of the way from 0.9 (step 20, 0.7 s) to 0.98 (step 30, 0.9 s).
    self.assertAlmostEqual(figures['time_to_target'], 0.7 + 0.625 * 0.2)
    self.assertAlmostEqual(figures['step_at_target'], 26.25)
    with_loss = real_run.at_target_loss(figures, target_loss=1.0)  # halfway from 1.5 to 0.5
    self.assertAlmostEqual(with_loss['time_to_target_loss'], 0.6)
    self.assertAlmostEqual(with_loss['step_at_target_loss'], 15.0)

  def test_per_iteration_time_leaves_out_the_first_row_and_counts_are_means(self):
    figures = real_run.figures(self.workdir, target_accuracy=0.95)
    self.assertAlmostEqual(figures['seconds_per_iteration'], 0.02)
    self.assertEqual(figures['counts'], [4.0, 1.5])
    self.assertEqual(figures['lowest_eval_loss'], 0.3)

  def test_warm_up_rows_are_left_out_and_times_to_target_counted_after_them(self):
    figures = real_run.figures(self.workdir, target_accuracy=0.95, warmup_rows=2)
    self.assertEqual((figures['first_step'], figures['first_time']), (20.0, 0.7))
    self.assertAlmostEqual(figures['seconds_per_iteration'], 0.02)
    self.assertEqual(figures['counts'], [4.0, 2.0])  # the third row only
    self.assertEqual(real_run.WARMUP_ROWS['nonblocking'], 2)

  def test_a_target_never_reached_is_none(self):
    figures = real_run.at_target_loss(real_run.figures(self.workdir, target_accuracy=0.99), target_loss=0.1)
    for key in ('time_to_target', 'step_at_target', 'time_to_target_loss', 'step_at_target_loss'):
      self.assertIsNone(figures[key], key)


class OverRoundsTest(absltest.TestCase):

  def _round(self, seconds, to_target, lowest=0.3):
    return {'seconds_per_iteration': seconds, 'time_to_target': to_target, 'step_at_target': to_target and 50,
            'time_to_target_loss': to_target, 'step_at_target_loss': to_target and 40, 'counts': [4.0, 1.0],
            'final_eval_accuracy': 0.97, 'speeds_s': [0.001, 0.004], 'overhead_s': [0.0, 0.0], 'num_params': 9,
            'lowest_eval_loss': lowest}

  def test_a_miss_counts_as_slower_than_every_hit(self):
    median = real_run.median_of([self._round(0.02, 1.0), self._round(0.03, None), self._round(0.01, 2.0)])
    self.assertEqual(median['time_to_target'], 2.0)
    self.assertEqual(median['seconds_per_iteration'], 0.02)
    self.assertEqual(median['range'], (0.01, 0.03))
    missed = real_run.median_of([self._round(0.02, None), self._round(0.03, None), self._round(0.01, 2.0)])
    self.assertIsNone(missed['time_to_target'])
    self.assertIsNone(missed['step_at_target_loss'])

  def test_default_target_loss_is_reached_by_every_run(self):
    runs = {'sync': [self._round(0.02, 1.0, lowest=0.2)], 'wagma': [self._round(0.02, 1.0, lowest=0.35)]}
    self.assertEqual(real_run.default_target_loss(runs), 0.35)

  def test_report_has_a_row_per_algorithm_with_the_prediction_and_the_ideals(self):
    rounds = lambda seconds, to_target: [self._round(seconds, to_target), self._round(seconds * 1.1, to_target)]
    results = {'nonblocking': real_run.median_of(rounds(0.01, 1.0)), 'sync': real_run.median_of(rounds(0.02, None))}
    settings = types.SimpleNamespace(microbatches=4, num_steps=200, repeats=1, debug_slow_process='1:0.004',
                                     target_accuracy=0.96, seeds=['0', '1'], profile='/tmp/this_machine.json')
    predicted = {'nonblocking': 0.011, real_run.IDEALS['nonblocking']: 0.002, 'sync': 0.018,
                 '_microbatch_s': [0.001, 0.005], '_counts': [4, 1]}
    measured = {'nonblocking': 0.009, 'sync': 0.016, '_slow_microbatch_s': 0.0045}
    with mock.patch.object(real_run, 'FLAGS', settings):
      text = real_run.report(results, predicted, measured, (1.0, 1.0), 0.3)
    # median 10.5 ms of 10 and 11 (mean 10.5 likewise), predicted 11: +5%; to the loss target 40 - 0 steps x 11 ms
    self.assertIn('| nonblocking | 10.50 (10.0-11.0) | 10.50 | 11.00 | +5% | 9.00 | 1.00 (50) | 0.55 | 1.00 (40) | '
                  '0.44 | -56% |', text)
    self.assertIn('| nonblocking, simulated ideal: first-finisher trigger | (no lock-step program) | | 2.00 |', text)
    self.assertIn('| sync | 21.00 (20.0-22.0) | 21.00 | 18.00 | -14% | 16.00 | not reached | - | not reached | - | - |',
                  text)
    self.assertIn('nonblocking < sync: same order', text)
    self.assertIn('measured it 4.50 ms', text)
    self.assertIn('target loss 0.3000', text)

  def test_one_run_per_algorithm_judges_no_ranking(self):
    results = {'a': real_run.median_of([self._round(0.01, 1.0)]), 'b': real_run.median_of([self._round(0.02, 1.0)])}
    self.assertEqual(real_run.ranking(results, {'a': 0.02, 'b': 0.01}), [])

  def test_the_slowed_workers_measured_microbatch_is_from_the_runs_that_ran_all_m(self):
    runs = {'sync': [{**self._round(0.02, 1.0), 'speeds_s': [0.001, 0.004], 'overhead_s': [0.0, 0.004]}],
            'nonblocking': [{**self._round(0.01, 1.0), 'speeds_s': [0.001, 0.009], 'overhead_s': [0.0, 0.0]}]}
    with mock.patch.object(real_run, 'FLAGS', types.SimpleNamespace(microbatches=4)):
      self.assertAlmostEqual(real_run.measured_slow_microbatch_s(runs, 1), 0.004 + 0.004 / 4)
      self.assertIsNone(real_run.measured_slow_microbatch_s(runs, -1))


class PredictionTest(absltest.TestCase):

  def test_the_deadline_rule_at_the_measured_round_gives_the_measured_counts(self):
    speeds, counts = [0.001, 0.004], [3.9, 1.2]  # means over rows: the counts that ran are 4 and 1
    deadline = real_run.measured_round_s(speeds, counts)
    self.assertAlmostEqual(deadline, 0.004)
    predicted = real_stragglers.simulate_iteration_seconds(np.array([speeds]), 4, 4000.0, 20, 4,
                                                           nonblocking_deadline_s=deadline)
    self.assertAlmostEqual(predicted['nonblocking_deadline'], 0.004)  # ideal network: the round's compute
    self.assertAlmostEqual(predicted['sync'], 0.016)  # every device all 4 micro-batches: the slow one's 4 x 4 ms


class ProfilePredictionTest(absltest.TestCase):

  def test_sync_on_a_profile_is_the_closed_form(self):
    profile = {'version': 1, 'name': 'round',
               'compute': {'digits/mlp': {'per_sample_s': {'value': 1e-4, 'source': 'test'},
                                          'overhead_s': {'value': 2e-3, 'source': 'test'}}},
               'network': {'allreduce': {'latency_s': {'value': 1e-4, 'source': 'test'},
                                         'bandwidth_gbps': {'value': 8.0, 'source': 'test'}},
                           'p2p': {'latency_s': {'value': 5e-5, 'source': 'test'},
                                   'bandwidth_gbps': {'value': 4.0, 'source': 'test'}}},
               'host_s': {'value': 3e-3, 'source': 'test'}}
    path = os.path.join(self.create_tempdir().full_path, 'round.json')
    with open(path, 'w') as f:
      json.dump(profile, f)
    settings = types.SimpleNamespace(microbatches=4, num_steps=200, eval_every=10, target_accuracy=0.96,
                                     local_steps=4, profile=path)
    with mock.patch.object(real_run, 'FLAGS', settings):
      predicted = real_run.predict_on_profile(['sync', 'nonblocking'], (1, 0.004), iterations=20)
    t = 2e-3 + 4 * 1e-4  # the profile's micro-batch of 16 / 4 samples; worker 1 sleeps 4 ms more in each
    np.testing.assert_allclose(predicted['_microbatch_s'], [t, t + 0.004])
    allreduce = 2 * 1e-4 + 38440 * 8 / 8e9  # the digits MLP's 38,440 bytes among 2
    self.assertAlmostEqual(predicted['sync'], 4 * (t + 0.004) + allreduce + 3e-3)
    self.assertEqual(predicted['_counts'], [4, 1])  # measured speeds cut the slow worker to one micro-batch
    self.assertLess(predicted['nonblocking'], predicted['sync'])
    self.assertIn(real_run.IDEALS['nonblocking'], predicted)  # the rule's own trigger, shown beside


class FlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('slow', {'debug_slow_process': '2:0.004'}, '^debug_slow_process='),
      ('loss', {'target_loss': float('nan')}, '^target_loss=nan .*finite number > 0'),
      ('accuracy', {'target_accuracy': 1.5}, r'^target_accuracy=1.5 .*\(0, 1\]'),
      ('repeats', {'repeats': 0}, '^repeats=0 .*>= 1'),
      ('seeds', {'seeds': ['x']}, r"^seeds=\['x'\] .*integers"),
      ('profile', {'profile': 'nowhere'}, r"^cluster\.profile='nowhere' .*shipped"),
  )
  def test_bad_flags_are_one_line_before_any_run(self, bad, message):
    settings = types.SimpleNamespace(**{'debug_slow_process': '1:0.004', 'target_loss': None,
                                        'target_accuracy': 0.96, 'repeats': 1, 'seeds': ['0'],
                                        'algorithms': ['sync'], 'profile': 'dgx_h100', 'microbatches': 4,
                                        'num_steps': 20, 'eval_every': 10, 'local_steps': 4, **bad})
    with mock.patch.object(real_run, 'FLAGS', settings), mock.patch.object(real_run, 'run') as run, \
         mock.patch('sys.stderr') as stderr, self.assertRaises(SystemExit) as exited:
      real_run.main(['real_run.py'])
    self.assertEqual(exited.exception.code, 2)
    run.assert_not_called()
    written = ''.join(call.args[0] for call in stderr.write.call_args_list)
    self.assertRegex(written.removeprefix('error: '), message)
    self.assertEqual(written.count('\n'), 1)


if __name__ == '__main__':
  absltest.main()
