"""`python -m waitless.experiments.calibrate`: a profile measured on this machine, readable by every program."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest

from waitless.cluster import profiles
from waitless.experiments import simulate
from waitless.experiments.configs import digits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args):
  return subprocess.run([sys.executable, '-m', 'waitless.experiments.calibrate', *args], cwd=ROOT,
                        capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONPATH=ROOT))


class CalibrateTest(absltest.TestCase):

  def test_one_process_cannot_measure_collectives(self):
    out = run('--config=experiments/configs/digits.py:sync', '--processes=1', '--out=/tmp/never.json')
    self.assertEqual(out.returncode, 2)
    self.assertRegex(out.stderr.strip(), r'^error: --processes=1 is not allowed: .*2 or more real processes')
    self.assertNotIn('Traceback', out.stderr)

  def test_bad_flags_are_refused_before_any_measurement(self):
    # Issue 59: a missing --out directory was a FileNotFoundError after minutes of measurements, one collective
    # size a ValueError after 80 s.
    tmp = self.create_tempdir().full_path
    for flags_, message in (
        ((f'--out={tmp}/missing/profile.json',), f'--out=.*{tmp}/missing does not exist'),
        ((f'--out={tmp}',), '--out=.* is not allowed: is a directory'),
        ((f'--out={tmp}/p.json', '--collective_sizes=4096'), r'--collective_sizes=.4096. .*two or more distinct'),
        ((f'--out={tmp}/p.json', '--collective_sizes=4096,abc'), r'--collective_sizes=.4096,abc. .*integers'),
        ((f'--out={tmp}/p.json', '--collective_sizes=0,4096'), r'--collective_sizes=.0,4096. .*integers >= 4'),
        ((f'--out={tmp}/p.json', '--processes=100000'), r'--processes=100000 is not allowed: .* JAX processes need'),
        ((f'--out={tmp}/p.json', 'extra'), r"unexpected argument\(s\) 'extra'"),
        ((f'--out={tmp}/p.json', '--config='), "--config='' is not allowed: name a config file")):
      out = run('--config=experiments/configs/digits.py:sync', *flags_)
      self.assertEqual(out.returncode, 2, out.stderr[-2000:])
      self.assertRegex(out.stderr.strip(), f'^error: {message}')
      self.assertNotIn('Traceback', out.stderr)
      self.assertLen(out.stderr.strip().splitlines(), 1)

  def test_the_docs_example_is_a_profile_every_program_reads(self):
    path = os.path.join(ROOT, 'docs', 'examples', 'this_machine.json')
    self.assertNotIn('this_machine', profiles.names())  # an example of calibrate's output, not a shipped cluster
    profile = profiles.load(path)
    config = digits.get_config('sync')
    config.cluster.profile = path
    result = simulate.simulate(config, iterations=10, nbytes=1e4)
    self.assertEqual(result['host_s'], profile.host_s)

  @pytest.mark.slow
  def test_writes_a_profile_every_program_reads(self):
    path = os.path.join(self.create_tempdir().full_path, 'here.json')
    out = run('--config=experiments/configs/digits.py:sync,microbatches=2', '--processes=2', f'--out={path}',
              '--rounds=1', '--repeats=3', '--harness_steps=20', '--harness_microbatches=2',
              '--collective_sizes=4096,4194304')
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    with open(path) as f:
      doc = json.load(f)
    self.assertEqual(doc['version'], profiles.VERSION)
    entry = doc['compute']['digits/mlp']
    for figure in (entry['per_sample_s'], entry['overhead_s'], doc['host_s'], doc['network']['p2p']['latency_s'],
                   doc['network']['allreduce']['bandwidth_gbps']):
      self.assertContainsSubset(['value', 'spread', 'rounds', 'dropped', 'source'], figure)
      self.assertIn('measured by experiments.calibrate', figure['source'])
    self.assertLen(doc['network']['allreduce']['latency_s']['load'], 1)  # the load when the round started
    self.assertIn('2-process local SGD', doc['host_s']['source'])  # the host as the processes pay it
    profile = profiles.load(path)
    config = digits.get_config('sync')
    config.cluster.profile = path
    result = simulate.simulate(config, iterations=10, nbytes=1e4)
    self.assertEqual(result['host_s'], profile.host_s)


if __name__ == '__main__':
  absltest.main()
