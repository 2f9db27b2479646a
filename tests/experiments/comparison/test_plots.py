"""The comparison's pictures and terminal summary: what a reader sees first."""

import os
from unittest import mock
import warnings

from absl.testing import absltest
import matplotlib

from waitless.experiments.comparison import plots
from waitless.experiments.comparison import report as report_lib
from tests.experiments import test_compare

matplotlib.use('Agg')


def _captured(draw):
  """The matplotlib figure `draw()` saves (its file is not written)."""
  saved = []
  with mock.patch.object(plots.atomic_files, 'save_figure', side_effect=lambda fig, path, **kw: saved.append(fig)):
    draw()
  return saved[0]


class PlotsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = self.create_tempdir().full_path
    self.runs = test_compare.ReportTest()._runs(self.root)  # sync and ksync,k=6 over 2 seeds; ksync faster

  def test_the_interval_plot_sorts_marks_the_baseline_and_colours_verdicts(self):
    report = report_lib.write_report(self.runs, self.root, 'test', target_accuracy=0.9)
    self.assertTrue(os.path.getsize(os.path.join(self.root, report_lib.INTERVALS_PNG)) > 10_000)
    fig = _captured(lambda: plots.intervals(report, os.path.join(self.root, 'x.png'), 'test'))
    times, wins = fig.axes[:2]
    names = [t.get_text() for t in times.get_yticklabels()]
    self.assertEqual(names, ['ksync,k=6 (learning_rate=0.1)', 'sync (learning_rate=0.05)  [baseline]'])  # fastest first
    self.assertEqual([t.get_fontweight() for t in times.get_yticklabels()], ['normal', 'bold'])
    bars = times.patches  # one interval bar per entry, in table order
    self.assertEqual([matplotlib.colors.to_hex(b.get_facecolor(), keep_alpha=False) for b in bars],
                     [matplotlib.colors.to_hex('tab:green'), matplotlib.colors.to_hex('black')])  # faster, baseline
    for bar, a in zip(bars, report['algorithms']):
      f = a['figures']['time_to_target_accuracy']
      self.assertAlmostEqual(bar.get_x(), f['low'])
      self.assertAlmostEqual(bar.get_x() + bar.get_width(), f['high'])
    self.assertIn('P(beats sync)', wins.get_xlabel())

  def test_the_verdict_legend_is_drawn_only_against_a_baseline(self):
    for baseline, legends in (('sync', 1), ('none', 0)):  # 'none': no entry of that name, so no baseline
      report = report_lib.write_report(self.runs, self.root, 'test', target_accuracy=0.9, baseline=baseline)
      with warnings.catch_warnings():
        warnings.simplefilter('error')  # matplotlib warned on the legend's handles without labels
        fig = _captured(lambda r=report: plots.intervals(r, os.path.join(self.root, 'x.png'), 'test'))
      self.assertLen(fig.legends, legends)
      if legends:
        self.assertEqual([t.get_text() for t in fig.legends[0].get_texts()],
                         ['faster than sync', 'tied', 'slower', 'baseline'])

  def test_an_entry_that_missed_is_drawn_as_a_bound_or_not_reached(self):
    report = report_lib.write_report(self.runs, self.root, 'test', target_accuracy=0.96)  # only ksync@0.1 hits
    fig = _captured(lambda: plots.intervals(report, os.path.join(self.root, 'x.png'), 'test'))
    texts = [t.get_text() for t in fig.axes[0].texts]
    self.assertIn('  not reached (2/2 missed)', texts)

  def test_curves_come_in_rows_of_at_most_six_with_the_baseline_in_each(self):
    entries = [{'entry': f'e{i}'} for i in range(18)]
    rows = plots.rows_of_entries(entries, 'e5')
    self.assertLen(rows, 4)  # 17 others, 5 a row beside the baseline
    for row in rows:
      self.assertLessEqual(len(row), plots.PER_ROW)
      self.assertIn(entries[5], row)
      self.assertEqual(row, sorted(row, key=entries.index))  # the table's order
    self.assertCountEqual([a['entry'] for row in rows for a in row if a['entry'] != 'e5'],
                          [f'e{i}' for i in range(18) if i != 5])
    self.assertEqual(plots.rows_of_entries(entries[:4], None), [entries[:4]])
    report = report_lib.write_report(self.runs, self.root, 'test', target_accuracy=0.9)
    self.assertTrue(os.path.getsize(report['png']) > 10_000)

  def test_the_terminal_ends_with_the_verdict_table_and_the_files(self):
    # Issue 39: it ended with the list of every run, and the verdict table scrolled out of sight.
    report = report_lib.write_report(self.runs, self.root, 'test', target_accuracy=0.9)
    lines = report_lib.terminal(report, self.root).splitlines()
    self.assertNotIn('## Runs', lines)
    self.assertFalse(any('seed 1 |' in line for line in lines))  # no run rows
    files = lines[-4:]
    self.assertEqual([line.rsplit(': ', 1)[1] for line in files],
                     [os.path.join(self.root, n) for n in ('comparison.md', 'comparison.json',
                                                           report_lib.INTERVALS_PNG, 'comparison.png')])
    self.assertIn('and the 8 runs', files[0])
    for line in files:
      self.assertTrue(os.path.exists(line.rsplit(': ', 1)[1]))
    table = [line for line in lines if line.startswith('| ')]
    self.assertTrue(table[-1].startswith('| sync @ optimizer.learning_rate=0.05 |'))
    self.assertEqual(lines.index(table[-1]) + 2, len(lines) - 4)  # the table, a blank line, the files


if __name__ == '__main__':
  absltest.main()
