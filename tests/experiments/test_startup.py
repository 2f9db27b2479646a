"""Start-up of `experiments.main`: the persistent compilation cache (on by default), and refused stray arguments."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest

from waitless.experiments.harness import metrics_io

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What JAX_LOG_COMPILES logs for each program it compiles or loads, and for each one it loads from the cache.
COMPILED, CACHE_HIT = 'Finished XLA compilation', 'Persistent compilation cache hit'


def _main(*args, env=None):
  run_env = {k: v for k, v in os.environ.items() if k != 'WAITLESS_COMPILATION_CACHE_DIR'}
  run_env.update(JAX_LOG_COMPILES='1', **(env or {}))
  return subprocess.run([sys.executable, '-m', 'waitless.experiments.main', *args], cwd=ROOT, capture_output=True,
                        text=True, env=run_env, timeout=600)


def _without_wall(workdir):
  rows = [{k: v for k, v in r.items() if k != 'wall_time'} for r in metrics_io.read_rows(workdir)]
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = {k: v for k, v in json.load(f).items() if k != 'wall_time'}
  return rows, summary


class StartupTest(absltest.TestCase):

  def test_a_stray_argument_is_refused_before_anything_runs(self):
    workdir = os.path.join(self.create_tempdir().full_path, 'w')
    result = _main('--config=experiments/configs/digits.py:sync,', 'seed=1', f'--workdir={workdir}')
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertIn("unexpected argument(s) 'seed=1'", result.stderr)
    self.assertFalse(os.path.exists(workdir))

  def test_a_digits_run_imports_only_what_it_uses(self):
    # scikit-learn (with scipy) only ships the data file; the TFDS and WMT pipelines, sentencepiece, TensorFlow
    # and the other models belong to other workloads.
    code = ('import sys\n'
            'from waitless.experiments.configs import digits\n'
            'from waitless.experiments.harness import setup\n'
            'from waitless.experiments.harness import train\n'
            'setup.build(digits.get_config("sync"))\n'
            'print(" ".join(sorted(sys.modules)))')
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    self.assertEqual(result.returncode, 0, result.stderr)
    loaded = set(result.stdout.split())
    self.assertIn('waitless.data.digits', loaded)
    unused = ('sklearn', 'scipy', 'sentencepiece', 'tensorflow', 'tensorflow_datasets', 'waitless.data.tfds_pipeline',
              'waitless.data.wmt', 'waitless.models.resnet', 'waitless.models.transformer', 'waitless.models.wrn')
    self.assertEmpty(sorted(loaded & set(unused)))

  @pytest.mark.slow
  def test_compilation_cache_skips_compilation_with_identical_results(self):
    cache = self.create_tempdir().full_path
    args = ['--config=experiments/configs/digits.py:sync', '--config.num_steps=20', '--config.eval_every=10',
            '--config.checkpoint_every=10']
    cold, warm, plain = (self.create_tempdir().full_path for _ in range(3))
    first = _main(*args, f'--workdir={cold}', f'--compilation_cache_dir={cache}')
    self.assertEqual(first.returncode, 0, first.stderr)
    self.assertGreater(first.stderr.count(COMPILED), 0)
    self.assertEqual(first.stderr.count(CACHE_HIT), 0)
    self.assertNotEmpty(os.listdir(cache))
    second = _main(*args, f'--workdir={warm}', env={'WAITLESS_COMPILATION_CACHE_DIR': cache})  # the env default
    self.assertEqual(second.returncode, 0, second.stderr)
    self.assertGreater(second.stderr.count(CACHE_HIT), 0)
    self.assertEqual(second.stderr.count(CACHE_HIT), second.stderr.count(COMPILED), second.stderr)
    third = _main(*args, f'--workdir={plain}', env={'WAITLESS_COMPILATION_CACHE_DIR': ''})  # '': none
    self.assertEqual(third.returncode, 0, third.stderr)
    self.assertGreater(third.stderr.count(COMPILED), 0)
    self.assertEqual(third.stderr.count(CACHE_HIT), 0)
    self.assertEqual(_without_wall(warm), _without_wall(cold))
    self.assertEqual(_without_wall(plain), _without_wall(cold))
    # Neither the flag nor the variable: the user's cache, $XDG_CACHE_HOME/waitless/jax.
    home, default = self.create_tempdir().full_path, self.create_tempdir().full_path
    fourth = _main(*args, f'--workdir={default}', env={'XDG_CACHE_HOME': home})
    self.assertEqual(fourth.returncode, 0, fourth.stderr)
    self.assertNotEmpty(os.listdir(os.path.join(home, 'waitless', 'jax')))
    self.assertEqual(_without_wall(default), _without_wall(cold))


if __name__ == '__main__':
  absltest.main()
