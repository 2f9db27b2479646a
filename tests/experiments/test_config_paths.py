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


class ParseFlagsTest(absltest.TestCase):

  def test_an_empty_config_or_a_directory_is_one_line(self):
    # Issue 59: `--config=` printed "Configuration is not available ... Is a directory".
    import subprocess
    import sys
    for value, message in (('', "--config='' is not allowed: name a config file"),
                           (':sync', "--config=':sync' is not allowed: name a config file"),
                           ('experiments/configs', 'is a directory, not a config file')):
      result = subprocess.run([sys.executable, '-m', 'waitless.experiments.simulate', f'--config={value}'], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
      self.assertEqual(result.returncode, 2, result.stderr)
      self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
      self.assertIn(message, result.stderr)


if __name__ == '__main__':
  absltest.main()
