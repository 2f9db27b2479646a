"""`benchmarks/testbed_predictions.py` without a bed: a run's figures from its files (median s/it after the first
row, the time to target from the end of that row), a cell's summary (median, range, the predicted time to target
as predicted s/it x the real steps) and the ranking check."""

import json
import os
import tempfile
from unittest import mock

from absl import flags
from absl.testing import absltest

from benchmarks import testbed_predictions as tp

# 10 steps a row: the first row slow (first executions), then 20 ms per iteration; accuracy crosses 0.9 at step 30.
ROWS = [{'step': 10, 'measured_time': 0.5, 'eval_accuracy': 0.5},
        {'step': 20, 'measured_time': 0.7, 'eval_accuracy': 0.8},
        {'step': 30, 'measured_time': 0.9, 'eval_accuracy': 0.9},
        {'step': 40, 'measured_time': 1.1, 'eval_accuracy': 0.95}]


class TestbedPredictionsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    values = flags.FlagValues()  # its own flags: another benchmark's test defines `algorithms` in the global ones
    tp.define_flags(values)
    values.mark_as_parsed()
    self.enter_context(mock.patch.object(tp, 'FLAGS', values))

  def test_figures(self):
    with tempfile.TemporaryDirectory() as workdir:
      with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in ROWS))
      got = tp.figures(workdir)
    self.assertAlmostEqual(got['seconds_per_iteration'], 0.02)
    self.assertAlmostEqual(got['median_row_s'], 0.02)
    self.assertAlmostEqual(got['time_to_target'], 0.4)  # 0.9 s at step 30, from the end of the first row (0.5 s)
    self.assertAlmostEqual(got['steps_to_target'], 20)

  def test_the_figure_is_the_runs_mean_rate_not_its_median_row(self):
    # Local SGD with H = 4 in rows of 10 steps: rows of 2 averages (cheap) and of 3 (dear) alternate 3 to 2, so the
    # median row is a cheap one; the run's rate, what `simulate` predicts, is their time over their steps.
    rows = [{'step': 10 * (i + 1), 'measured_time': t} for i, t in enumerate([0.5, 0.8, 1.1, 1.5, 1.8, 2.2])]
    with tempfile.TemporaryDirectory() as workdir:
      with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in rows))
      got = tp.figures(workdir)
    self.assertAlmostEqual(got['median_row_s'], 0.03)
    self.assertAlmostEqual(got['seconds_per_iteration'], 1.7 / 50)
    self.assertIsNone(got['time_to_target'])

  def test_summarize(self):
    runs = [{'seconds_per_iteration': s, 'time_to_target': 20 * s, 'steps_to_target': 20} for s in (0.02, 0.03, 0.025)]
    got = tp.summarize(runs, 0.0275)
    self.assertAlmostEqual(got['real_s'], 0.025)
    self.assertEqual(got['range'], (0.02, 0.03))
    self.assertAlmostEqual(got['error'], 0.1)
    self.assertAlmostEqual(got['predicted_target_s'], 0.55)
    self.assertAlmostEqual(got['target_error'], 0.1)
    self.assertAlmostEqual(got['early_rows'], 1.0)  # every run's rows to the target at its median rate

  def test_a_missed_target_counts_as_infinite(self):
    runs = [{'seconds_per_iteration': 0.02, 'time_to_target': None, 'steps_to_target': None}] * 2 + [
        {'seconds_per_iteration': 0.02, 'time_to_target': 0.4, 'steps_to_target': 20}]
    got = tp.summarize(runs, 0.02)
    self.assertIsNone(got['real_target_s'])
    self.assertIsNone(got['predicted_target_s'])

  def test_ranking_judges_separated_pairs_only(self):
    cell = lambda lo, hi, predicted: {'range': (lo, hi), 'predicted_s': predicted, 'runs': 8}
    cells = {('sync', 'equal'): cell(0.08, 0.09, 0.08), ('local_sgd', 'equal'): cell(0.02, 0.03, 0.03),
             ('dpsgd', 'equal'): cell(0.085, 0.11, 0.07)}
    tp.FLAGS.algorithms, tp.FLAGS.conditions = ['sync', 'local_sgd', 'dpsgd'], ['equal']
    lines = tp.ranking(cells)
    self.assertEqual(lines, ['equal: local_sgd < sync: same order', 'equal: local_sgd < dpsgd: same order'])
    cells['local_sgd', 'equal'] = cell(0.02, 0.03, 0.09)
    self.assertIn('REVERSED', tp.ranking(cells)[0])


  def test_the_slow_hosts_factor_is_the_measured_one_where_the_profile_has_it(self):
    # Issue 56: the quotas' ratio (2) was the slow host's factor; the half-quota host measured 2.2x slower.
    with open(os.path.join(tp.ROOT, 'docs', 'examples', 'testbed_174.json')) as f:
      doc = json.load(f)
    doc['compute']['digits/mlp'].pop('per_cpu', None)
    path = os.path.join(self.create_tempdir().full_path, 'p.json')
    with open(path, 'w') as f:
      json.dump(doc, f)
    tp.FLAGS.profile = path
    self.assertEqual(tp.model_key(), 'digits/mlp')
    self.assertEqual(tp.worker_factors([0.8, 0.4], 'digits/mlp'), ((1.0, 2.0), 'quota ratio'))
    doc['compute']['digits/mlp']['per_cpu'] = {'0.8': {'value': 1.2e-5, 'source': 'test'},
                                               '0.4': {'value': 2.64e-5, 'source': 'test'}}
    with open(path, 'w') as f:
      json.dump(doc, f)
    factors, source = tp.worker_factors([0.8, 0.4], 'digits/mlp')
    self.assertSequenceAlmostEqual(factors, (1.0, 2.2))
    self.assertEqual(source, 'per_cpu')
    self.assertEqual(tp.worker_factors([0.8, 0.2], 'digits/mlp'), ((1.0, 4.0), 'quota ratio'))  # 0.2 not measured


if __name__ == '__main__':
  absltest.main()
