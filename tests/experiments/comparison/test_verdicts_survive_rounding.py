"""Verdicts that survive rounding: the same comparison at two device layouts (different float32 rounding, as on
another machine) gives the same faster / slower / tied verdicts, though not the same digits."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest

from waitless.experiments.comparison import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The quickstart's workload, cluster and budget, one step size; entries of every kind of verdict against sync.
COMMAND = ['--config=experiments/configs/mnist1d.py:sync,stragglers=heterogeneous',
           '--algorithms=sync,ksync,k=6,local_sgd,dpsgd,kasync,k=4,lap_sgd', '--seeds=5', '--sim_time=8',
           '--max_steps=4500', '--evals=20', '--compilation_cache_dir=']


def _compare(workdir: str, devices: int) -> dict:
  done = subprocess.run([sys.executable, '-m', 'waitless.experiments.compare', *COMMAND, f'--workdir={workdir}',
                         f'--config.devices={devices}'], cwd=ROOT, capture_output=True, text=True, timeout=1800)
  if done.returncode != 0:
    raise AssertionError(f'compare at {devices} devices exited {done.returncode}: {done.stderr[-3000:]}')
  with open(os.path.join(workdir, 'comparison.json')) as f:
    return json.load(f)


class VerdictsSurviveRoundingTest(absltest.TestCase):

  @pytest.mark.slow
  def test_eight_and_four_devices_give_the_same_verdicts(self):
    eight = _compare(self.create_tempdir().full_path, 8)  # one worker per device
    four = _compare(self.create_tempdir().full_path, 4)   # two workers vmapped per device: other rounding
    verdicts = statistics.verdicts(eight)
    self.assertLen(verdicts, 5)  # every entry but the baseline has one
    self.assertEqual(set(verdicts.values()), {'faster', 'slower', 'tied'})  # not agreeing by being all alike
    self.assertEqual(statistics.verdicts(four), verdicts)
    # The rounding really differs: some run's final loss is not the same to every digit.
    losses = lambda report: [r['final_eval_loss'] for r in report['runs']]
    self.assertNotEqual(losses(eight), losses(four))


if __name__ == '__main__':
  absltest.main()
