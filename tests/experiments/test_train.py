"""End-to-end runs of `train_and_evaluate` and of the command line: accuracy, outputs, resume, errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from waitless import config_errors as errors
from waitless.experiments.configs import digits
from waitless.experiments.configs import wmt
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from waitless.experiments.harness import workdir as workdir_lib
from tests import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strip_wall(rows):
  return [{k: v for k, v in r.items() if k != 'wall_time'} for r in rows]


def _summary_without_wall(workdir):
  with open(os.path.join(workdir, 'summary.json')) as f:
    return {k: v for k, v in json.load(f).items() if k != 'wall_time'}


def _main(args, **kwargs):
  return subprocess.run([sys.executable, '-m', 'waitless.experiments.main', *args], cwd=ROOT, capture_output=True,
                        text=True, **kwargs)


class TrainTest(parameterized.TestCase):

  def test_digits_sync_default_reaches_90_percent_and_writes_its_outputs(self):
    workdir = self.create_tempdir().full_path
    summary = train.train_and_evaluate(digits.get_config('sync'), workdir)
    self.assertGreaterEqual(summary['final_eval_accuracy'], 0.90)
    self.assertEqual(summary['steps'], 300)
    for name in ('metrics.jsonl', 'summary.json', 'config.json', 'checkpoints', 'tensorboard'):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
    saved = _summary_without_wall(workdir)
    for key in ('steps', 'sim_time', 'final_train_loss', 'final_eval_loss', 'final_eval_accuracy', 'param_norm',
                'time_to_target'):
      self.assertIn(key, saved)
    self.assertIsInstance(saved['param_norm'], float)
    rows = metrics_io.read_rows(workdir)
    self.assertEqual([r['step'] for r in rows], list(range(10, 301, 10)))
    for row in rows:
      self.assertTrue({'step', 'sim_time', 'wall_time', 'train_loss'} <= set(row))
    evals = [r for r in rows if 'eval_accuracy' in r]
    self.assertEqual([r['step'] for r in evals], [50, 100, 150, 200, 250, 300])
    first_hit = next(r['sim_time'] for r in evals if r['eval_accuracy'] >= 0.9)
    self.assertEqual(saved['time_to_target'], first_hit)
    # Constant 10 ms per micro-batch, ideal network: sync takes exactly 10 ms per iteration.
    self.assertAlmostEqual(saved['sim_time'], 300 * 0.01, places=9)

  def test_a_rows_parameter_norm_is_the_one_at_its_step(self):
    # Two blocks per metrics row: l2_params is measured after each block and the row keeps the last one, so it
    # equals the (identical) sync workers' final norm; a mean over the window's blocks would not.
    config = digits.get_config('sync')
    config.num_steps, config.steps_per_call, config.log_every = 20, 5, 10
    config.eval_every = config.checkpoint_every = 20
    workdir = self.create_tempdir().full_path
    summary = train.train_and_evaluate(config, workdir)
    rows = metrics_io.read_rows(workdir)
    self.assertEqual([r['step'] for r in rows], [10, 20])
    self.assertAlmostEqual(rows[-1]['l2_params'], summary['param_norm'], delta=1e-6 * summary['param_norm'])
    self.assertNotAlmostEqual(rows[0]['l2_params'], rows[-1]['l2_params'], delta=1e-4 * summary['param_norm'])

  def test_resume_from_an_earlier_checkpoint_replays_the_same_run(self):
    config = harness.synthetic_config('local_sgd,local_steps=3', num_steps=40, checkpoint_every=10, log_every=5,
                                      eval_every=20, steps_per_call=4)
    full = self.create_tempdir().full_path
    train.train_and_evaluate(config, full)
    crashed = self.create_tempdir().full_path
    train.train_and_evaluate(config, crashed)
    # As if the process died just after step 20's checkpoint: later checkpoints and the summary never happened.
    for name in os.listdir(os.path.join(crashed, 'checkpoints')):
      if name.isdigit() and int(name) > 20:
        shutil.rmtree(os.path.join(crashed, 'checkpoints', name))
    os.remove(os.path.join(crashed, 'summary.json'))
    train.train_and_evaluate(config, crashed)
    self.assertEqual(_summary_without_wall(crashed), _summary_without_wall(full))
    self.assertEqual(_strip_wall(metrics_io.read_rows(crashed)), _strip_wall(metrics_io.read_rows(full)))

  def test_resume_after_kill_minus_9_equals_the_uninterrupted_run(self):
    args = ['--config=experiments/configs/digits.py:local_sgd,local_steps=2,num_steps=1500,checkpoint_every=100,'
            'eval_every=250,log_every=50,steps_per_call=1']
    full = self.create_tempdir().full_path
    self.assertEqual(_main(args + [f'--workdir={full}'], timeout=600).returncode, 0)
    killed = self.create_tempdir().full_path
    proc = subprocess.Popen([sys.executable, '-m', 'waitless.experiments.main', *args, f'--workdir={killed}'], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      steps = [int(n) for n in os.listdir(os.path.join(killed, 'checkpoints'))
               if n.isdigit()] if os.path.isdir(os.path.join(killed, 'checkpoints')) else []
      if steps and max(steps) >= 300:
        break
      time.sleep(0.05)
    self.assertIsNone(proc.poll(), 'the run finished before it could be killed; make it longer')
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    self.assertFalse(os.path.exists(os.path.join(killed, 'summary.json')))
    resumed = _main(args + [f'--workdir={killed}'], timeout=600)
    self.assertEqual(resumed.returncode, 0, resumed.stderr)
    self.assertIn('Resumed from the checkpoint', resumed.stderr)
    self.assertEqual(_summary_without_wall(killed), _summary_without_wall(full))
    self.assertEqual(_strip_wall(metrics_io.read_rows(killed)), _strip_wall(metrics_io.read_rows(full)))

  @parameterized.named_parameters(
      ('unknown_algorithm', 'bogus', 'algorithm.name=.bogus. is not allowed: known algorithms: .*local_sgd.*sync'),
      ('unknown_key', 'sync,nonsense=1', "config argument='nonsense' is not allowed: unknown key; known: "),
      ('workers_not_multiple', 'sync,workers=6', 'workers=6 is not allowed: must be a multiple of devices=8'),
      ('zero_steps', 'sync,num_steps=0', 'num_steps=0 is not allowed: must be an integer >= 1'),
      ('negative_batch', 'sync,batch_size=-4', 'batch_size=-4 is not allowed: must be an integer >= 1'),
      ('bad_local_steps', 'local_sgd,local_steps=0', 'algorithm.local_steps=0 is not allowed'),
      # 61 GB of thread views: refused from the state's shapes (disk or memory), before anything is allocated.
      ('state_too_large', 'lap_sgd,threads=100000',
       '(workdir .* MB free but two checkpoints of this run need|workers=8 is not allowed: this run needs about)'),
      ('more_workers_than_data', 'sync,workers=1000,devices=8', 'workers=1000 is not allowed: 1437 training'),
      # Issue 59: the clock's host memory, estimated before anything is allocated (it grew until killed).
      ('clock_too_large', 'sync,workers=1073741824,devices=8',
       'workers=1073741824 is not allowed: the simulated clock of 1073741824 workers'))
  def test_bad_config_is_one_line_and_exit_2(self, arg, message):
    result = _main([f'--config=experiments/configs/digits.py:{arg}', f'--workdir={self.create_tempdir().full_path}'])
    self.assertEqual(result.returncode, 2, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    self.assertLen(lines, 1, result.stderr)
    self.assertRegex(lines[0], '^error: ' + message)
    self.assertNotIn('Traceback', result.stderr)

  @pytest.mark.slow
  def test_a_mock_data_dry_run_prints_its_own_lines_only(self):
    result = _main(['--config=experiments/configs/cifar10.py:sync,num_steps=2,eval_every=2,batch_size=8',
                    '--mock_data', f'--workdir={self.create_tempdir().full_path}'], timeout=600)
    self.assertEqual(result.returncode, 0, result.stderr[-2000:])
    self.assertNotIn('TensorInfo.dtype', result.stderr)
    self.assertIn('compiling the block step', result.stderr)
    self.assertIn('summary:', result.stderr)

  def test_validation_names_the_field(self):
    config = digits.get_config('sync')
    config.microbatches = 3
    with self.assertRaisesRegex(errors.ConfigError, 'microbatches=3 .*must divide batch_size=16'):
      validation.validate(config)
    config = digits.get_config('sync')
    config.optimizer.momentum = 1.5
    with self.assertRaisesRegex(errors.ConfigError, r'optimizer.momentum=1.5'):
      validation.validate(config)

  def test_a_workdir_with_an_unreadable_config_is_refused_in_one_line(self):
    workdir = self.create_tempdir().full_path
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write('{"algorithm": {"na')
    with self.assertRaisesRegex(workdir_lib.WorkdirConflict, 'unreadable config.json .*use a new --workdir'):
      workdir_lib.check_workdir(workdir, harness.synthetic_config('sync', num_steps=5, eval_every=5))

  def test_every_field_of_summary_json_is_documented(self):
    # Issue 39: `replicas` was missing from the table of outputs.
    summary = train.train_and_evaluate(harness.synthetic_config('sync', num_steps=2, eval_every=2),
                                       self.create_tempdir().full_path)
    with open(os.path.join(ROOT, 'docs', 'experiments.md')) as f:
      row = next(line for line in f if line.startswith('| `summary.json` |'))
    self.assertEqual([k for k in summary if f'`{k}`' not in row], [])

  def test_a_workdir_with_another_config_is_refused(self):
    workdir = self.create_tempdir().full_path
    train.train_and_evaluate(harness.synthetic_config('sync', num_steps=5, eval_every=5), workdir)
    with self.assertRaisesRegex(workdir_lib.WorkdirConflict, 'num_steps'):
      train.train_and_evaluate(harness.synthetic_config('sync', num_steps=6, eval_every=5), workdir)
    # Fields that do not change the trajectory (evaluation batching, BLEU settings) may change on resume.
    config = harness.synthetic_config('sync', num_steps=5, eval_every=5, eval_batch_size=7)
    config.bleu = wmt.get_config('sync').bleu
    self.assertEqual(train.train_and_evaluate(config, workdir)['steps'], 5)

  def test_divergence_stops_with_the_step_and_keeps_the_last_checkpoint(self):
    config = harness.synthetic_config('sync', num_steps=40, checkpoint_every=5, eval_every=5, log_every=5,
                                      steps_per_call=5, **{'optimizer.learning_rate': 50.0})
    workdir = self.create_tempdir().full_path
    with self.assertRaisesRegex(recorder_lib.TrainingDiverged, r'at step \d+; stopped, the last good checkpoint'):
      train.train_and_evaluate(config, workdir)


if __name__ == '__main__':
  absltest.main()
