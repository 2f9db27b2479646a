"""experiments.comparison.statistics: medians with bootstrap intervals, censored misses, paired probabilities, verdicts,
tuning seeds apart from reporting seeds; the report built from fake run workdirs (no training)."""

import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.comparison import plots
from waitless.experiments.comparison import report as report_lib
from waitless.experiments.comparison import statistics
from waitless.experiments.comparison.plan import PlannedRun

TARGET = 0.5
BUDGET = 10.0


def _write(workdir, time_to_target, budget=BUDGET, final_loss=0.1):
  """A finished run whose eval accuracy crosses TARGET exactly at `time_to_target` (None: never) and ends at
  `budget` simulated seconds."""
  os.makedirs(workdir, exist_ok=True)
  points = [(0.0, 0.0)]
  if time_to_target is not None:
    points += [(time_to_target, TARGET)] if time_to_target < budget else []
    points += [(budget, 0.9 if time_to_target < budget else TARGET)]
  else:
    points += [(budget, TARGET - 0.1)]
  rows = [{'step': 10 * (i + 1), 'sim_time': t, 'wall_time': 0.0, 'train_loss': 1 - a, 'idle_fraction': 0.2,
           'staleness': 0.0, 'bytes_communicated': 1.0, 'eval_accuracy': a, 'eval_loss': 1 - a}
          for i, (t, a) in enumerate(points)]
  rows[-1]['eval_loss'] = final_loss
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in rows))
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump({'steps': rows[-1]['step'], 'sim_time': budget, 'wall_time': 1.0,
               'final_eval_accuracy': rows[-1]['eval_accuracy'], 'final_eval_loss': final_loss,
               'time_to_target': time_to_target}, f)


def _runs(root, times, final_loss=None):
  """PlannedRuns with written workdirs: `times` maps (entry, sweep value or None) to one time per seed."""
  runs = []
  for (entry, value), per_seed in times.items():
    sweep = (('optimizer.learning_rate', value),) if value is not None else ()
    for seed, t in enumerate(per_seed):
      workdir = os.path.join(root, entry, value or '', f'seed{seed}')
      _write(workdir, t, final_loss=(final_loss or {}).get((entry, value), 0.1))
      runs.append(PlannedRun(entry=entry, sweep=sweep, seed=seed, workdir=workdir, config=None))
  return runs


def _by_entry(report):
  return {a['entry']: a for a in report['algorithms']}


class MedianTest(absltest.TestCase):

  def test_a_seed_that_misses_is_counted_not_dropped(self):
    f = statistics.describe_censored([1.0, 2.0, 4.0, 5.0, None], [BUDGET] * 5)
    self.assertEqual((f['n'], f['censored']), (5, 1))
    self.assertEqual(f['median'], 4.0)  # dropping the miss would give 3.0
    self.assertLessEqual(f['low'], f['median'])
    # One miss in five: more than 2.5% of resamples draw it three times, so the upper end depends on it.
    self.assertIsNone(f['high'])
    self.assertEqual(f['high_above'], BUDGET)

  def test_more_than_half_missing_is_above_the_budget(self):
    f = statistics.describe_censored([1.0, None, 2.0, None, None], [BUDGET] * 5)
    self.assertEqual((f['median'], f['median_above']), (None, BUDGET))
    self.assertEqual((f['high'], f['high_above']), (None, BUDGET))
    self.assertEqual(f['low'], 1.0)

  def test_half_missing_of_an_even_count_is_a_lower_bound(self):
    f = statistics.describe_censored([1.0, 3.0, None, None], [BUDGET] * 4)
    self.assertIsNone(f['median'])
    self.assertEqual(f['median_above'], (3.0 + BUDGET) / 2)  # the midpoint with the misses at their budget

  def test_the_bound_is_each_missing_seeds_own_budget(self):
    f = statistics.describe_censored([None, None, 1.0], [4.0, 6.0, 8.0])
    self.assertEqual(f['median_above'], 4.0)

  def test_all_missing_and_none(self):
    f = statistics.describe_censored([None, None], [3.0, 3.0])
    self.assertEqual((f['censored'], f['median'], f['median_above'], f['low_above']), (2, None, 3.0, 3.0))
    self.assertEqual(statistics.describe_censored([], [])['median'], None)

  def test_one_seed_has_no_interval(self):
    f = statistics.describe_censored([2.0], [BUDGET])
    self.assertEqual((f['median'], f['low'], f['high'], f['low_above']), (2.0, None, None, None))

  def test_uncensored_figures_leave_out_what_is_missing(self):
    f = statistics.describe([0.9, None, 0.8, float('nan'), 0.7])
    self.assertEqual((f['n'], f['of'], f['median']), (3, 5, 0.8))
    self.assertEqual((f['low'], f['high']), (0.7, 0.9))

  def test_the_interval_narrows_with_seeds(self):
    values = np.linspace(1.0, 2.0, 21)
    f = statistics.describe(list(values))
    self.assertGreater(f['low'], values[0])
    self.assertLess(f['high'], values[-1])
    self.assertLess(f['low'], f['median'])
    self.assertGreater(f['high'], f['median'])

  def test_the_confidence_level_is_used(self):
    values = list(np.linspace(1.0, 2.0, 21))
    wide, narrow = statistics.describe(values, 0.99), statistics.describe(values, 0.5)
    self.assertLess(wide['low'], narrow['low'])
    self.assertGreater(wide['high'], narrow['high'])


class ProbabilityTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('wins_and_a_tie', [1, 2, 3, 4], [2, 1, 4, 4], 2.5 / 4),
      ('a_miss_loses_to_any_time', [None, 1], [9, 2], 0.5),
      ('both_missing_is_a_tie', [None, None, 1], [None, 2, 2], (0.5 + 0 + 1) / 3),
      ('paired_not_pooled', [1, 2, 3, 4, 5], [1.5, 2.5, 3.5, 4.5, 5.5], 1.0))
  def test_probability_of_improvement(self, x, y, expected):
    self.assertAlmostEqual(statistics.probability_of_improvement(x, y)['p'], expected)

  def test_seeds_are_resampled_in_pairs(self):
    # Every seed is a win; resampling the two entries' seeds independently would draw losses too.
    p = statistics.probability_of_improvement([1, 2, 3, 4, 5], [1.5, 2.5, 3.5, 4.5, 5.5])
    self.assertEqual((p['low'], p['high']), (1.0, 1.0))

  def test_interval_of_two_seeds_one_win(self):
    # Resampled pairs: two wins (1/4), one of each (1/2), two losses (1/4): the interval is [0, 1].
    p = statistics.probability_of_improvement([1, 3], [2, 2])
    self.assertEqual((p['p'], p['low'], p['high']), (0.5, 0.0, 1.0))
    self.assertEqual((p['wins'], p['ties'], p['losses']), (1, 0, 1))

  @parameterized.named_parameters(
      # Ten seeds: the resampled share of wins is Binomial(10, w)/10; its 2.5% and 97.5% quantiles.
      ('nine_of_ten', 9, 0.7, 1.0, 'faster'),
      ('eight_of_ten', 8, 0.5, 1.0, 'tied'),
      ('five_of_ten', 5, 0.2, 0.8, 'tied'),
      ('one_of_ten', 1, 0.0, 0.3, 'slower'))
  def test_interval_and_verdict_on_ten_seeds(self, wins, low, high, expected):
    x = [1.0] * wins + [3.0] * (10 - wins)
    p = statistics.probability_of_improvement(x, [2.0] * 10)
    self.assertAlmostEqual(p['p'], wins / 10)
    self.assertAlmostEqual(p['low'], low)
    self.assertAlmostEqual(p['high'], high)
    self.assertEqual(statistics.verdict(p), expected)

  @parameterized.named_parameters(
      ('above', 0.51, 1.0, 'faster', 'ahead'), ('below', 0.0, 0.49, 'slower', 'behind'),
      ('touches', 0.5, 0.9, 'tied', 'tied'), ('around', 0.2, 0.8, 'tied', 'tied'),
      ('no_interval', None, None, 'tied', 'tied'))
  def test_verdict_rules(self, low, high, expected, mark):
    p = {'p': 0.7, 'low': low, 'high': high}
    self.assertEqual(statistics.verdict(p), expected)
    self.assertEqual(statistics.mark_against_best(p), mark)


class OptionsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('all_seeds_tune', 3, 3, 0.95, '--tuning_seeds=3 is not allowed'),
      ('more_than_seeds', 3, 4, 0.95, '--tuning_seeds=4 is not allowed'),
      ('negative', 3, -1, 0.95, '--tuning_seeds=-1 is not allowed'),
      ('confidence_one', 3, 0, 1.0, '--confidence=1.0 is not allowed'),
      ('confidence_zero', 3, 0, 0.0, '--confidence=0.0 is not allowed'),
      ('confidence_percent', 3, 0, 95.0, '--confidence=95.0 is not allowed'),
      ('confidence_nan', 3, 0, math.nan, '--confidence=nan is not allowed'))
  def test_bad_options_name_the_flag(self, seeds, tuning, confidence, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      statistics.check_options(seeds, tuning, confidence)

  def test_good_options(self):
    statistics.check_options(3, 2, 0.5)
    statistics.check_options(1, 0, 0.99)

  def test_summarize_checks_them(self):
    runs = _runs(self.create_tempdir().full_path, {('sync', None): [1.0, 2.0]})
    with self.assertRaisesRegex(errors.ConfigError, '--tuning_seeds'):
      statistics.summarize(runs, TARGET, tuning_seeds=2)


class ReportTest(absltest.TestCase):

  def test_censored_seeds_in_the_table(self):
    root = self.create_tempdir().full_path
    runs = _runs(root, {('sync', None): [2.0, 2.1, 2.2, 2.3, 2.4],
                        ('misses_one', None): [1.0, 1.1, None, 1.3, 1.4],
                        ('misses_three', None): [1.0, None, None, 1.3, None]})
    report = report_lib.write_report(runs, root, 'test', TARGET)
    by = _by_entry(report)
    one = by['misses_one']['figures']['time_to_target_accuracy']
    self.assertEqual((one['median'], one['censored'], one['n']), (1.3, 1, 5))  # 1.2 if the miss were dropped
    three = by['misses_three']['figures']['time_to_target_accuracy']
    self.assertEqual((three['median'], three['median_above'], three['high_above']), (None, BUDGET, BUDGET))
    text = open(os.path.join(root, 'comparison.md')).read()
    self.assertIn('| misses_one | 1.3 [1, > 10] (1/5 missed) |', text)
    self.assertIn('| misses_three | > 10 [1, > 10] (3/5 missed) |', text)
    self.assertIn('Figures over 5 reporting seed(s) (seeds 0-4) (no sweep', text)
    # A miss loses to any time: misses_three beats sync on seeds 0 and 3 only.
    self.assertAlmostEqual(by['misses_three']['beats_baseline']['time_to_target_accuracy']['p'], 0.4)
    self.assertEqual([a['entry'] for a in report['algorithms']], ['misses_one', 'sync', 'misses_three'])

  def test_verdicts_against_the_baseline_and_the_best(self):
    root = self.create_tempdir().full_path
    base = [2.0, 2.1, 2.2, 2.3, 2.4]
    runs = _runs(root, {('sync', None): base,
                        ('fast', None): [t - 1.0 for t in base],                  # first on every seed
                        ('close', None): [0.9, 1.3, 1.0, 1.5, 1.5],               # beats fast on 2 of 5
                        ('mixed', None): [1.9, 2.2, 2.1, 2.4, 2.3],               # beats sync on 3 of 5
                        ('slow', None): [t + 1.0 for t in base[:4]] + [None]})    # last on every seed
    report = statistics.summarize(runs, TARGET)
    self.assertEqual(statistics.verdicts(report), {'fast': 'faster', 'close': 'faster', 'mixed': 'tied',
                                                   'slow': 'slower'})
    by = _by_entry(report)
    self.assertEqual(report['best'], 'fast')
    self.assertEqual({e: a['against_best'] for e, a in by.items()},
                     {'fast': 'best', 'close': 'tied', 'sync': 'behind', 'mixed': 'behind', 'slow': 'behind'})
    self.assertAlmostEqual(by['close']['beats_best']['p'], 0.4)
    self.assertIsNone(by['sync']['verdict'])
    text = report_lib.markdown(report, 'test')
    self.assertIn('| close | 1.3 [0.9, 1.5] | 1.00 [1.00, 1.00] | faster | tied |', text)
    self.assertIn('| sync | 2.2 [2, 2.4] | - | baseline | behind |', text)
    self.assertIn('tied if its interval contains 0.5', text)

  def test_no_baseline_no_verdicts(self):
    runs = _runs(self.create_tempdir().full_path, {('a', None): [1.0, 2.0], ('b', None): [2.0, 3.0]})
    report = statistics.summarize(runs, TARGET, baseline='sync')
    self.assertIsNone(report['baseline'])
    self.assertEqual(statistics.verdicts(report), {})

  def test_same_files_same_report(self):
    root = self.create_tempdir().full_path
    runs = _runs(root, {('sync', '0.1'): [2.0, 2.5, None, 2.1, 3.0], ('sync', '0.2'): [1.0, None, None, 2.0, 2.2],
                        ('fast', '0.1'): [1.0, 1.7, 2.1, None, 1.2], ('fast', '0.2'): [1.1, 1.2, 1.3, 1.4, 1.5]})
    first = report_lib.write_report(runs, root, 'test', TARGET, tuning_seeds=2)
    files = [open(os.path.join(root, name)).read() for name in ('comparison.md', 'comparison.json')]
    second = report_lib.write_report(runs, root, 'test', TARGET, tuning_seeds=2)
    self.assertEqual([open(os.path.join(root, name)).read() for name in ('comparison.md', 'comparison.json')], files)
    self.assertEqual(first, second)


class TuningSeedsTest(absltest.TestCase):
  """On seeds 0-1 the learning rate 0.1 is fast, on seeds 2-4 it is 0.2: who chooses decides."""

  TIMES = {('sync', '0.1'): [1.0, 1.1, 5.0, 5.1, 5.2], ('sync', '0.2'): [4.0, 4.1, 2.0, 2.1, 2.2],
           ('other', '0.1'): [3.0, 3.0, 3.0, 3.0, 3.0], ('other', '0.2'): [2.0, 2.0, 2.0, None, 2.0]}

  def test_the_choice_is_made_on_tuning_seeds_only(self):
    root = self.create_tempdir().full_path
    report = report_lib.write_report(_runs(root, self.TIMES), root, 'test', TARGET, tuning_seeds=2)
    sync = _by_entry(report)['sync']
    self.assertEqual(sync['best_sweep'], {'optimizer.learning_rate': '0.1'})
    self.assertEqual(report['seeds'], {'all': [0, 1, 2, 3, 4], 'tuning': [0, 1], 'reporting': [2, 3, 4],
                                       'sweeping': True, 'chosen_on': 'tuning'})
    text = open(os.path.join(root, 'comparison.md')).read()
    self.assertIn("Tuning: seeds 0-1 chose each entry's sweep point; every figure of this table is over the other "
                  '3 reporting seed(s) (seeds 2-4).', text)
    self.assertIn('## Every sweep point\n\nOver the tuning seeds 0-1', text)
    self.assertIn('| sync @ optimizer.learning_rate=0.1 seed 0 (tuning) |', text)
    self.assertIn('| sync @ optimizer.learning_rate=0.1 seed 2 | finished |', text)
    # The sweep table holds the tuning seeds' figures: 0.1's median over seeds 0-1.
    point = next(g for g in report['sweep'] if g['entry'] == 'sync' and g['sweep']['optimizer.learning_rate'] == '0.1')
    self.assertAlmostEqual(point['figures']['time_to_target_accuracy']['median'], 1.05)
    self.assertEqual(point['seeds'], [0, 1])

  def test_tuning_seeds_are_left_out_of_every_reported_figure(self):
    root = self.create_tempdir().full_path
    report = statistics.summarize(_runs(root, self.TIMES), TARGET, tuning_seeds=2)
    by = _by_entry(report)
    t = by['sync']['figures']['time_to_target_accuracy']
    self.assertEqual((t['values'], t['median'], t['n']), ([5.0, 5.1, 5.2], 5.1, 3))
    self.assertEqual(by['sync']['figures']['final_eval_loss']['of'], 3)
    self.assertEqual(by['other']['best_sweep'], {'optimizer.learning_rate': '0.2'})  # 2.0 on both tuning seeds
    other = by['other']['figures']['time_to_target_accuracy']
    self.assertEqual((other['values'], other['censored']), ([2.0, None, 2.0], 1))
    beats = by['other']['beats_baseline']['time_to_target_accuracy']
    self.assertEqual((beats['seeds'], beats['p']), ([2, 3, 4], 2 / 3))
    self.assertEqual(by['sync']['seeds'], [2, 3, 4])

  def test_without_tuning_seeds_the_choice_sees_the_reported_seeds(self):
    root = self.create_tempdir().full_path
    report = report_lib.write_report(_runs(root, self.TIMES), root, 'test', TARGET)
    by = _by_entry(report)
    self.assertEqual(by['sync']['best_sweep'], {'optimizer.learning_rate': '0.2'})  # median 2.2 against 5.0
    self.assertEqual(by['sync']['figures']['time_to_target_accuracy']['median'], 2.2)
    self.assertEqual(report['seeds']['tuning'], [])
    self.assertIn('that selection is optimistic', open(os.path.join(root, 'comparison.md')).read())

  def test_the_final_loss_breaks_a_tie_of_misses(self):
    root = self.create_tempdir().full_path
    times = {('sync', '0.1'): [None, None], ('sync', '0.2'): [None, None]}
    report = statistics.summarize(_runs(root, times, final_loss={('sync', '0.2'): 0.05}), TARGET, tuning_seeds=1)
    self.assertEqual(_by_entry(report)['sync']['best_sweep'], {'optimizer.learning_rate': '0.2'})

  def test_without_a_sweep_every_seed_reports(self):
    root = self.create_tempdir().full_path
    report = statistics.summarize(_runs(root, {('sync', None): [1.0, 2.0, 3.0]}), TARGET, tuning_seeds=2)
    self.assertEqual((report['seeds']['tuning'], report['seeds']['reporting']), ([], [0, 1, 2]))
    self.assertEqual(_by_entry(report)['sync']['figures']['time_to_target_accuracy']['n'], 3)


class PlotTest(absltest.TestCase):

  def test_the_line_is_the_median_and_the_band_its_interval(self):
    root = self.create_tempdir().full_path
    scale = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0]  # one outlier seed: the mean would follow it
    records = []
    for seed, s in enumerate(scale):
      workdir = os.path.join(root, f'seed{seed}')
      os.makedirs(workdir)
      with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
        f.write(''.join(json.dumps({'step': i, 'sim_time': float(i), 'eval_loss': s * i}) + '\n' for i in (1, 2, 3)))
      records.append({'workdir': workdir})
    grid, median, low, high = plots._curve(records, 'sim_time', 'eval_loss', 0.95)
    np.testing.assert_array_equal(grid, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(median, 4.0 * grid)
    values = np.outer(scale, grid)
    self.assertTrue(np.all(low > values.min(0)), 'not the lowest seed')   # seven seeds: narrower than min-max
    self.assertTrue(np.all(high < values.max(0)), 'not the highest seed')
    self.assertTrue(np.all((low <= median) & (median <= high)))
    one = plots._curve(records[:1], 'sim_time', 'eval_loss', 0.95)
    self.assertEqual((one[2], one[3]), (None, None))


class RunFiguresTest(parameterized.TestCase):

  @parameterized.parameters('sim_time', 'measured_time')
  def test_a_run_is_timed_by_the_clock_that_wrote_it(self, field):
    rows = [{'step': 10, field: 0.5, 'eval_accuracy': 0.4, 'eval_loss': 1.0},
            {'step': 20, field: 1.25, 'eval_accuracy': 0.9, 'eval_loss': 0.3}]
    unfinished = statistics.run_figures(rows, None, 0.8, None)
    finished = statistics.run_figures(rows, {'steps': 20, field: 1.5}, 0.8, None)
    self.assertEqual(unfinished['sim_time'], 1.25)
    self.assertEqual(finished['sim_time'], 1.5)
    self.assertEqual(unfinished['time_to_target_at_eval'], 1.25)


if __name__ == '__main__':
  absltest.main()
