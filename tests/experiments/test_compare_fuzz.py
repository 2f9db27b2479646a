"""Fuzzing what a comparison takes in: its flags, its runs' files, its checkpoints, replicas on several processes.

Flags: each case sets one to three flags to values no comparison may take (out of range, NaN, infinities, a
duplicate or malformed sweep, a sweep of a seed or a cluster field, an unknown baseline, a seed out of range, an
unknown or unbindable algorithm entry) beside a valid tiny comparison, runs compare, and checks: exit status 2,
one line `error: ...` naming one of the bad flags (or the config field a bad sweep value sets), no traceback,
nothing written to the workdir.
Runs' files: a finished run whose metrics.jsonl or summary.json is damaged (deleted, cut, rows lost, a value
changed) is refused in one line naming the file or read as unfinished (trained again), never reported as a run
that missed its target or with other figures.
Checkpoints: the newest checkpoint of a stopped run damaged at random (bytes flipped or cut anywhere, a file
deleted, meta edited): the resumed run ends exactly as an uninterrupted one, a damage it noticed reported in one
line and set aside.
Replicas on several processes: `--seeds` >= 2 over 2 processes, random step and checkpoint cadences, finishes
with every seed's summary.
The cases are drawn from fixed seeds (the same every run); the representative subsets run a few of them,
`--all` (pytest -m slow) many more.
"""

import json
import os
import random
import shutil
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from waitless.experiments.comparison import statistics
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import train
from tests import harness
from tests.experiments import test_compare
from tests.experiments import test_train
from tests.experiments.harness import test_multiprocess
from tests.experiments.harness import test_preemption

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


# ---- the runs' files --------------------------------------------------------------------------------------

def _drop_metrics(workdir):
  os.remove(os.path.join(workdir, 'metrics.jsonl'))


def _empty_metrics(workdir):
  open(os.path.join(workdir, 'metrics.jsonl'), 'w').close()


def _cut_metrics(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  text = open(path).read()
  with open(path, 'w') as f:
    f.write(text[:len(text) // 2 + 3])


def _lose_last_rows(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  lines = open(path).read().splitlines(keepends=True)
  with open(path, 'w') as f:
    f.writelines(lines[:-1])


def _change_final_accuracy(workdir):
  path = os.path.join(workdir, 'summary.json')
  summary = atomic_files.read_json(path)
  if summary is not None:  # not one torn already
    summary['final_eval_accuracy'] = summary['final_eval_accuracy'] - 0.01
    atomic_files.write_json(path, summary)


def _tear_summary(workdir):
  path = os.path.join(workdir, 'summary.json')
  text = open(path).read()
  with open(path, 'w') as f:
    f.write(text[:len(text) // 2])


FILE_DAMAGE = {'drop_metrics': _drop_metrics, 'empty_metrics': _empty_metrics, 'cut_metrics': _cut_metrics,
               'lose_last_rows': _lose_last_rows, 'change_final_accuracy': _change_final_accuracy,
               'tear_summary': _tear_summary}


class RunFilesFuzzTest(parameterized.TestCase):
  """Every damage of a finished run's files, alone or two together, on one of three seeds."""

  @parameterized.named_parameters(*[(f'{a}_{b}_seed{s}', a, b, s) for i, (a, b, s) in enumerate(
      (x, y, s) for x in FILE_DAMAGE for y in (None, *FILE_DAMAGE) for s in range(3)) if i % 7 == 0])
  def test_a_damaged_finished_run_is_refused_or_retrained_never_a_miss(self, first, second, seed):
    root = self.create_tempdir().full_path
    runs = test_compare.ReportTest()._runs(root)
    run = next(r for r in runs if r.seed == runs[0].seed + seed % 2 and r.entry == 'ksync,k=6')
    before = statistics.read_run(run)
    figures = statistics.run_figures(before['rows'], before['summary'], 0.9, None)
    for damage in (first, second):
      needs = 'summary.json' if damage in ('change_final_accuracy', 'tear_summary') else 'metrics.jsonl'
      if damage is not None and os.path.exists(os.path.join(run.workdir, needs)):
        FILE_DAMAGE[damage](run.workdir)
    try:
      after = statistics.read_run(run)
    except metrics_io.CutLog as e:
      self.assertNotIn('\n', str(e))
      self.assertRegex(str(e), f'^{run.workdir}/metrics.jsonl .*remove that run\'s workdir')
      return
    if after['status'] is None:  # a torn summary: the run is not finished, and a rerun trains it again
      return
    self.assertEqual(after['status'], 'finished')
    self.assertEqual(statistics.run_figures(after['rows'], after['summary'], 0.9, None), figures)


# ---- checkpoints ------------------------------------------------------------------------------------------

def _files(step_dir):
  return sorted(os.path.join(root, n) for root, _, names in os.walk(step_dir) for n in names)


def _damage_checkpoint(step_dir, rng):
  """One random damage: bytes flipped or cut in a random file, a file deleted, or meta edited."""
  kind = rng.choice(('flip', 'flip', 'cut', 'delete', 'meta'))
  files = [f for f in _files(step_dir) if os.path.getsize(f) > 0]
  if kind == 'meta':
    path = os.path.join(step_dir, 'meta', 'metadata')
    meta = json.load(open(path))
    meta['positions'] = [p + 1 for p in meta['positions']]
    json.dump(meta, open(path, 'w'))
    return kind
  path = rng.choice(files)
  size = os.path.getsize(path)
  if kind == 'delete':
    os.remove(path)
  elif kind == 'cut':
    with open(path, 'r+b') as f:
      f.truncate(rng.randrange(size))
  else:
    offset, length = rng.randrange(size), rng.choice((1, 8, 64))
    with open(path, 'r+b') as f:
      f.seek(offset)
      data = f.read(length)
      f.seek(offset)
      f.write(bytes(b ^ (1 << rng.randrange(8)) for b in data))
  return f'{kind} {os.path.relpath(path, step_dir)}'


class _CheckpointChecks(parameterized.TestCase):
  """The newest checkpoint of a stopped run damaged at random: the resumed run ends as an uninterrupted one."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = harness.synthetic_config('kasync,k=2', num_steps=30, checkpoint_every=10, log_every=5,
                                          eval_every=10, steps_per_call=5)
    cls.full = os.path.join(absltest.get_default_test_tmpdir(), 'checkpoint_fuzz_full')
    shutil.rmtree(cls.full, ignore_errors=True)
    train.train_and_evaluate(cls.config, cls.full)

  def _check(self, seed):
    rng = random.Random(seed)
    workdir = self.create_tempdir().full_path
    with self.assertRaises(preemption.Preempted):  # checkpoints 10 and 20
      train.train_and_evaluate(self.config, workdir, stop_requests=test_preemption.StopAt(15))
    what = _damage_checkpoint(os.path.join(workdir, 'checkpoints', '20'), rng)
    with self.assertLogs('waitless', level='INFO') as logs:
      train.train_and_evaluate(self.config, workdir)
    warnings = [r.getMessage() for r in logs.records if r.levelname == 'WARNING']
    set_aside = os.path.isdir(os.path.join(workdir, 'corrupt_checkpoints', '20'))
    self.assertLen(warnings, 1 if set_aside else 0, (what, warnings))
    for warning in warnings:
      self.assertRegex(warning, r'^checkpoint at step 20 is unreadable \(.*\); trying the previous one$')
    self.assertEqual(test_train._summary_without_wall(workdir), test_train._summary_without_wall(self.full), what)
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(workdir)),
                     test_train._strip_wall(metrics_io.read_rows(self.full)), what)



class CheckpointFuzzTest(_CheckpointChecks):

  @parameterized.parameters(*range(4))
  def test_a_damaged_checkpoint_never_changes_the_run(self, seed):
    self._check(seed)


class CheckpointFuzzManyTest(_CheckpointChecks):
  pytestmark = pytest.mark.slow

  @parameterized.parameters(*range(4, 24))
  def test_a_damaged_checkpoint_never_changes_the_run_many(self, seed):
    self._check(seed)


# ---- replicas on several processes ------------------------------------------------------------------------

def _replica_cases(count: int, seed: int):
  rng = random.Random(seed)
  for i in range(count):
    steps = rng.choice((20, 30, 40))
    every = rng.choice((10, steps // 2, steps))
    yield (f'case{i}', rng.choice(('sync', 'local_sgd', 'kasync,k=4')), rng.choice((2, 3)), steps, every)


class _ReplicasChecks(parameterized.TestCase):
  """--seeds over 2 processes (each replica checkpoints at the same steps as the others)."""

  def _check(self, algorithm, seeds, steps, every):
    workdir = self.create_tempdir().full_path
    result = test_multiprocess._launch(2, [
        f'--config=experiments/configs/digits.py:{algorithm},num_steps={steps},checkpoint_every={every},'
        f'eval_every={every}', f'--seeds={seeds}', f'--workdir={workdir}'], timeout=300)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertNotRegex(result.stderr, test_multiprocess.C_ABORT)
    for s in range(seeds):
      with open(os.path.join(workdir, f'seed{s}', 'summary.json')) as f:
        self.assertEqual(json.load(f)['steps'], steps)



class ReplicasOnProcessesFuzzTest(_ReplicasChecks):

  def test_three_seeds_checkpointing_every_ten_steps(self):  # the representative: about 10 s
    self._check('sync', 3, 20, 10)


class ReplicasOnProcessesFuzzManyTest(_ReplicasChecks):
  pytestmark = pytest.mark.slow

  @parameterized.named_parameters(*_replica_cases(6, seed=3))
  def test_replicas_on_two_processes(self, algorithm, seeds, steps, every):
    self._check(algorithm, seeds, steps, every)


if __name__ == '__main__':
  absltest.main()
