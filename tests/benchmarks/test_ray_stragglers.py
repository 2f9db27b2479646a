"""The Ray straggler benchmark's prediction: the simulator with the learners' measured job times gives the
closed forms (no Ray started here)."""

from absl.testing import absltest
from absl.testing import parameterized

from benchmarks import cli
from benchmarks import ray_stragglers


class PredictionTest(parameterized.TestCase):

  @parameterized.parameters(
      ('async', (0.02, 0.02, 0.02, 0.02), 0.005),         # P learners pushing every T: T / P per update
      ('sync', (0.02, 0.02, 0.02, 0.08), 0.08),           # every learner every update: the slowest
      ('ksync,k=3', (0.02, 0.02, 0.02, 0.08), 0.02))      # the 3 fast ones
  def test_persistent_speeds_give_the_closed_form(self, arg, intervals, expected):
    config = ray_stragglers.config_for(arg, seed=0)
    config.num_steps = 400
    predicted = ray_stragglers.predicted_update_s(config, 'slowed', intervals)
    self.assertAlmostEqual(predicted, expected, delta=0.03 * expected)

  def test_spread_says_median_and_range_and_what_was_not_reached(self):
    self.assertEqual(cli.spread([3.0, 1.0, 2.0]), '2 [1, 3]')
    self.assertEqual(cli.spread([None, None]), 'not reached')


if __name__ == '__main__':
  absltest.main()
