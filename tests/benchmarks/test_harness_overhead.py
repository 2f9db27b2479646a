"""The harness benchmark's arithmetic: steady-state rates inside a run, rounds too short to time."""

from absl.testing import absltest
import numpy as np

from benchmarks import harness_overhead


class SteadyRateTest(absltest.TestCase):

  def test_rate_leaves_out_the_start_and_the_last_mark(self):
    steps = np.arange(10, 1010, 10)
    seconds = 2.0 + steps / 500.0  # 2 s of start-up, then 500 steps/s
    seconds[:5] += 1.0            # a slow first quarter (compilation): left out
    seconds[-1] += 3.0            # the end's evaluation and checkpoint: left out
    self.assertAlmostEqual(harness_overhead.steady_rate(steps, seconds), 500.0)

  def test_too_few_marks_or_no_time_is_no_rate(self):
    self.assertTrue(np.isnan(harness_overhead.steady_rate([10, 20], [1.0, 2.0])))
    self.assertTrue(np.isnan(harness_overhead.steady_rate([10, 20, 30, 40], [1.0, 1.0, 1.0, 1.0])))

  def test_invalid_rounds_are_dropped_and_counted(self):
    text = harness_overhead.describe_ratio(np.array([0.9, np.nan, 0.8, 1.0, 0.85]))
    self.assertEqual(text, "0.88x, the median of 4 rounds' ratios (range 0.80x to 1.00x; 1 round(s) dropped: "
                           'too short to time)')
    self.assertIn('no valid round', harness_overhead.describe_ratio(np.array([np.nan, np.nan])))


if __name__ == '__main__':
  absltest.main()
