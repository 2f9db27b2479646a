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
    {'step': 10, 'sim_time': 0.5, 'eval_accuracy': 0.5, 'eval_loss': 1.5, 'microbatches_done': [4, 1]},
    {'step': 20, 'sim_time': 0.7, 'eval_accuracy': 0.9, 'eval_loss': 0.5, 'microbatches_done': [4, 1]},
    {'step': 30, 'sim_time': 0.9, 'eval_accuracy': 0.98, 'eval_loss': 0.3, 'microbatches_done': [4, 2]},
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

  def test_report_has_a_row_per_algorithm_with_the_prediction(self):
    results = {'nonblocking': real_run.median_of([self._round(0.01, 1.0)]),
               'sync': real_run.median_of([self._round(0.02, None)])}
    settings = types.SimpleNamespace(microbatches=4, num_steps=200, repeats=1, debug_slow_process='1:0.004',
                                     target_accuracy=0.96)
    predicted = {'nonblocking': 0.001, 'nonblocking_deadline': 0.005, 'sync': 0.01}
    with mock.patch.object(real_run, 'FLAGS', settings):
      text = real_run.report(results, predicted, (1.0, 1.0), 0.3)
    # nonblocking's row is the rule that ran (the deadline trigger), the first finisher's in a line above.
    self.assertIn('| nonblocking | 10.00 (10.0-10.0) | 5.00 | 2.00 | 1.00 (50) | 0.25 | 1.00 (40) | 0.20 |', text)
    self.assertIn("first-finisher trigger, which gives a device that finished none 0, predicts 1.00 ms/it", text)
    self.assertIn('| sync | 20.00 (20.0-20.0) | 10.00 | 2.00 | not reached | - | not reached | - |', text)
    self.assertIn('target loss 0.3000', text)


class PredictionTest(absltest.TestCase):

  def test_the_deadline_rule_at_the_measured_round_gives_the_measured_counts(self):
    speeds, counts = [0.001, 0.004], [3.9, 1.2]  # means over rows: the counts that ran are 4 and 1
    deadline = real_run.measured_round_s(speeds, counts)
    self.assertAlmostEqual(deadline, 0.004)
    predicted = real_stragglers.simulate_iteration_seconds(np.array([speeds]), 4, 4000.0, 20, 4,
                                                           nonblocking_deadline_s=deadline)
    self.assertAlmostEqual(predicted['nonblocking_deadline'], 0.004)  # ideal network: the round's compute
    self.assertAlmostEqual(predicted['sync'], 0.016)  # every device all 4 micro-batches: the slow one's 4 x 4 ms


class FlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('slow', {'debug_slow_process': '2:0.004'}, '^debug_slow_process='),
      ('loss', {'target_loss': float('nan')}, '^target_loss=nan .*finite number > 0'),
      ('accuracy', {'target_accuracy': 1.5}, r'^target_accuracy=1.5 .*\(0, 1\]'),
      ('repeats', {'repeats': 0}, '^repeats=0 .*>= 1'),
  )
  def test_bad_flags_are_one_line_before_any_run(self, bad, message):
    settings = types.SimpleNamespace(**{'debug_slow_process': '1:0.004', 'target_loss': None,
                                        'target_accuracy': 0.96, 'repeats': 1, **bad})
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
