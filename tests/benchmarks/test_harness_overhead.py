"""The harness benchmark's arithmetic: rates from run-length differences, rounds that noise made invalid."""

from absl.testing import absltest
import numpy as np

from benchmarks import harness_overhead


class PairRateTest(absltest.TestCase):

  def test_rate_is_the_extra_steps_over_the_extra_seconds(self):
    seconds = {1000: 3.0, 2000: 5.0}  # 2 s of start-up, 1,000 steps per 2 s
    self.assertAlmostEqual(harness_overhead._pair_rate(seconds.__getitem__, 2000), 500.0)

  def test_a_long_run_that_was_not_slower_is_no_rate(self):
    seconds = {1000: 3.0, 2000: 3.0}
    self.assertTrue(np.isnan(harness_overhead._pair_rate(seconds.__getitem__, 2000)))

  def test_invalid_rounds_are_dropped_and_counted(self):
    text = harness_overhead.describe_ratio(np.array([0.9, np.nan, 0.8, 1.0, 0.85]))
    self.assertEqual(text, "0.88x, the median of 4 rounds' ratios (range 0.80x to 1.00x; 1 round(s) dropped: "
                           'the long run was not slower)')
    self.assertIn('no valid round', harness_overhead.describe_ratio(np.array([np.nan, np.nan])))


if __name__ == '__main__':
  absltest.main()
