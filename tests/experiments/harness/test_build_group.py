"""Building the runs of one program (`setup.build_group`): a long build says how far it is, and the runs share their
dataset's arrays (thousands of `--seeds` replicas read the digits file once, not once each)."""

from unittest import mock

from absl.testing import absltest

from waitless.experiments.configs import digits
from waitless.experiments.harness import setup


def _seeds(n: int):
  configs = []
  for seed in range(n):
    config = digits.get_config('sync,workers=2,devices=1')
    config.seed = seed
    configs.append(config)
  return configs


class BuildGroupTest(absltest.TestCase):

  def test_a_long_build_says_how_far_it_is(self):
    with mock.patch.object(setup, 'PROGRESS_EVERY_S', -1.0), self.assertLogs('waitless', 'INFO') as logs:
      group = setup.build_group(_seeds(3))
    self.assertEqual(group.size, 3)
    progress = [r.getMessage() for r in logs.records if 'runs of one program' in r.getMessage()]
    self.assertEqual(progress, [f'built {i} of 3 runs of one program (data, model, transformation)'
                                for i in (1, 2, 3)])

  def test_the_runs_share_their_arrays_and_keep_their_own_data_order(self):
    group = setup.build_group(_seeds(2))
    first, second = (run.dataset.train for run in group.runs)
    self.assertIs(first._arrays['image'], second._arrays['image'])
    self.assertNotEqual(first._shards.tolist(), second._shards.tolist())


if __name__ == '__main__':
  absltest.main()
