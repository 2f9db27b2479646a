"""`--config=FILE` from anywhere, and from a flagfile (launch/quickstart.flags)."""

import os

from absl.testing import absltest

from waitless.experiments import config_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ResolveArgvTest(absltest.TestCase):

  def test_a_flagfile_is_expanded_and_its_config_resolved(self):
    # absl reads a --flagfile only while parsing: the config's path in it must be resolved as on the command line
    # ("No such file or directory: 'experiments/configs/mnist1d.py'" otherwise).
    flagfile = self.create_tempfile(content='--config=experiments/configs/digits.py:sync,workers=4\n'
                                    '--seeds=3\n').full_path
    argv = config_paths.resolve_argv(['compare', f'--flagfile={flagfile}', '--seeds=5'])
    config = next(a for a in argv if a.startswith('--config='))
    self.assertTrue(os.path.exists(config[len('--config='):].partition(':')[0]), config)
    self.assertTrue(config.endswith('digits.py:sync,workers=4'))
    self.assertEqual([a for a in argv if a.startswith('--seeds')], ['--seeds=3', '--seeds=5'])  # the last wins

  def test_the_quickstart_flags_name_an_existing_config_and_a_shipped_profile(self):
    argv = config_paths.resolve_argv(['compare', f'--flagfile={os.path.join(ROOT, "launch", "quickstart.flags")}'])
    config = next(a for a in argv if a.startswith('--config='))
    self.assertTrue(os.path.exists(config[len('--config='):].partition(':')[0]), config)
    self.assertIn('--config.cluster.profile=commodity_10gbe', argv)
    self.assertIn('--algorithms=all', argv)


if __name__ == '__main__':
  absltest.main()
