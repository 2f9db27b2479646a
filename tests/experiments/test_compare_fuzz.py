"""Bad values of experiments.compare's flags, alone and together, are refused in one line before anything runs.

Each case sets one to three flags to values no comparison may take (out of range, NaN, infinities, a duplicate
or malformed sweep, an unknown or unbindable algorithm entry) beside a valid tiny comparison, runs compare, and
checks: exit status 2, one line `error: ...` naming one of the bad flags (or the config field a bad sweep value
sets), no traceback, nothing written to the workdir. The cases are drawn from a fixed seed (the same every
run); the representative subset runs a few of them, `--all` (pytest -m slow) many more.
"""

import os
import random
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VALID = ['--config=experiments/configs/digits.py', '--algorithms=sync', '--config.num_steps=2',
         '--config.eval_every=1']
# flag -> [(bad value, extra valid flags it needs, what the error names)]
BAD = {
    '--seeds': [('0', [], '--seeds'), ('-3', [], '--seeds')],
    '--tuning_seeds': [('2', ['--seeds=2'], '--tuning_seeds'), ('-1', ['--seeds=2'], '--tuning_seeds')],
    '--confidence': [('0', [], '--confidence'), ('1.5', [], '--confidence'), ('nan', [], '--confidence')],
    '--sim_time': [('0', [], '--sim_time'), ('-1', [], '--sim_time'), ('nan', [], '--sim_time'),
                   ('inf', [], '--sim_time')],
    '--max_steps': [('0', ['--sim_time=0.1'], '--max_steps'), ('5', [], '--max_steps')],
    '--evals': [('0', ['--sim_time=0.1'], '--evals')],
    '--target_loss': [('nan', [], '--target_loss'), ('-1', [], '--target_loss'), ('inf', [], '--target_loss')],
    '--sweep': [('optimizer.learning_rate=0.1,0.1', [], '--sweep'), ('nokey', [], '--sweep'),
                ('optimizer.learning_rate=-1', [], 'optimizer.learning_rate'), ('seed=0,1', [], '--sweep'),
                ('stragglers.overhead_s=0,0.001', [], '--sweep')],
    '--config.seed': [('99999999999999999999', [], 'seed'), ('2147483647', ['--seeds=2'], '--seeds')],
    '--algorithms': [('bogus', [], 'algorithm'), ('all,k=2', [], '--algorithms'), ('k=2', [], '--algorithms')],
    '--max_replicas': [('0', ['--seeds=2'], '--max_replicas')],
    '--baseline': [('snyc', [], '--baseline'), ('local_sgd', [], '--baseline')],
}


def _cases(count: int, seed: int = 0):
  rng = random.Random(seed)
  flags = sorted(BAD)
  for i in range(count):
    chosen = rng.sample(flags, rng.choice((1, 1, 2, 3)))
    args, names = [], []
    for flag in chosen:
      value, extra, name = rng.choice(BAD[flag])
      args += [f'{flag}={value}', *extra]
      names.append(name)
    yield f'case{i}_' + '_'.join(f.strip('-') for f in chosen), args, names


class _Checks(parameterized.TestCase):

  def _check(self, args, names):
    workdir = os.path.join(self.create_tempdir().full_path, 'cmp')
    # The bad flags come after the valid ones: absl keeps the last value of a repeated flag.
    result = subprocess.run([sys.executable, '-m', 'waitless.experiments.compare', *VALID, f'--workdir={workdir}',
                             *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    self.assertLen([line for line in lines if line.startswith('error: ')], 1, result.stderr)
    self.assertTrue(lines[-1].startswith('error: '), lines[-1])
    self.assertTrue(any(name in lines[-1] for name in names), f'{lines[-1]!r} names none of {names}')
    self.assertNotIn('Traceback', result.stderr)
    self.assertFalse(os.path.exists(os.path.join(workdir, 'comparison.md')))



class CompareFlagsFuzzTest(_Checks):

  @parameterized.named_parameters(*_cases(6))
  def test_refused_in_one_line(self, args, names):
    self._check(args, names)


class CompareFlagsFuzzManyTest(_Checks):
  pytestmark = pytest.mark.slow  # (absl's parameterized methods do not carry a method's mark)

  @parameterized.named_parameters(*_cases(40, seed=1))
  def test_refused_in_one_line_many(self, args, names):
    self._check(args, names)


if __name__ == '__main__':
  absltest.main()
