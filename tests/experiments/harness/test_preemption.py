"""Preemption: a stop request finishes the block, checkpoints, and the rerun equals an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.experimental import multihost_utils
import numpy as np
import pytest

from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import train
from tests import harness
from tests.experiments import test_train


class StopAt(preemption.StopRequests):
  """Asks to stop at the first block that starts at or after `step` (what a signal does, deterministically)."""

  def __init__(self, step: int):
    super().__init__()
    self.at = step

  def agreed(self, step: int, checkpoint_due: bool = False) -> preemption.Agreement:
    if step >= self.at:
      self.request('test')
    return super().agreed(step, checkpoint_due)


class PreemptionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('local_sgd', 'local_sgd,local_steps=3'),   # lookahead on (the stop must cancel it), rounds of 3
      ('kasync', 'kasync,k=2'),                   # vectorised clock, stale views
      ('adasync', 'adasync,k0=2,adapt_every_s=0.05'))  # loss feedback: no lookahead at all
  def test_stop_checkpoints_and_the_rerun_equals_an_uninterrupted_run(self, arg):
    config = harness.synthetic_config(arg, num_steps=40, checkpoint_every=20, log_every=5, eval_every=20,
                                      steps_per_call=4)
    full = self.create_tempdir().full_path
    train.train_and_evaluate(config, full)
    stopped = self.create_tempdir().full_path
    # Blocks (steps_per_call 4, log_every 5): [0,4) [4,5) [5,8) [8,10) [10,12) [12,15): the request seen at
    # the block starting at 12 stops after it, at 15.
    with self.assertRaisesRegex(preemption.Preempted, r'preempted by test at step 15: checkpoint saved in'):
      train.train_and_evaluate(config, stopped, stop_requests=StopAt(11))
    self.assertFalse(os.path.exists(os.path.join(stopped, 'summary.json')))
    checkpoints = sorted(int(n) for n in os.listdir(os.path.join(stopped, 'checkpoints')) if n.isdigit())
    self.assertEqual(checkpoints[-1], 15)  # the end of the block running at the request, not step 20
    train.train_and_evaluate(config, stopped)
    self.assertEqual(test_train._summary_without_wall(stopped), test_train._summary_without_wall(full))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(stopped)),
                     test_train._strip_wall(metrics_io.read_rows(full)))

  @parameterized.named_parameters(
      # (this process's checkpoint period passed, the peer's [stop, checkpoint] wishes) -> (stop, checkpoint)
      ('peer_due', False, [0, 1], (False, True)),
      ('own_due', True, [0, 0], (False, True)),
      ('peer_stops', False, [1, 0], (True, True)),  # a stop checkpoints
      ('nobody', False, [0, 0], (False, False)))
  def test_every_process_agrees_on_a_wish_of_any(self, due, peer, expected):
    stops = preemption.StopRequests()
    with mock.patch.object(jax, 'process_count', return_value=2), \
         mock.patch.object(multihost_utils, 'process_allgather', side_effect=lambda x: np.stack([x, peer])):
      agreed = stops.agreed(0, checkpoint_due=due)
    self.assertEqual(tuple(agreed), expected)
    self.assertEqual(stops.signal_name, 'a peer process' if expected[0] else None)  # who asked, for the message

  def test_a_second_signal_stops_at_once(self):
    stops = preemption.StopRequests()
    with stops:
      os.kill(os.getpid(), signal.SIGTERM)
      self.assertEqual(stops.signal_name, 'SIGTERM')
      with self.assertRaises(KeyboardInterrupt) as raised:
        os.kill(os.getpid(), signal.SIGINT)
      self.assertEqual(preemption.exit_code(raised.exception), 130)  # Ctrl-C twice: interrupted
      with self.assertRaises(KeyboardInterrupt) as raised:
        os.kill(os.getpid(), signal.SIGTERM)
      self.assertEqual(preemption.exit_code(raised.exception), preemption.EXIT_PREEMPTED)  # the scheduler again
    self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)  # handlers restored

  @parameterized.named_parameters(
      # 0.5 s: still importing jaxlib and TensorFlow (a SystemExit or a KeyboardInterrupt raised there crashed the
      # interpreter's shutdown, status 139, or printed a traceback): stopped before training, one line.
      # 1.5 s: setting up (the data, the initialisation, the first compile) or, since issue 40 made a digits
      # run's start-up shorter than that, its first steps: either one line, with the status that line implies.
      ('sigterm', signal.SIGTERM, 1.5, preemption.EXIT_PREEMPTED),
      ('sigterm_importing', signal.SIGTERM, 0.5, preemption.EXIT_PREEMPTED),
      ('ctrl_c', signal.SIGINT, 1.5, 130),
      ('ctrl_c_importing', signal.SIGINT, 0.5, 130),
  )
  def test_a_signal_while_starting_exits_with_one_line(self, signum, after_s, status):
    workdir = self.create_tempdir().full_path
    name = signal.Signals(signum).name
    for module in ('waitless.experiments.main', 'waitless.experiments.compare'):
      extra = ['--algorithms=sync'] if module == 'waitless.experiments.compare' else []
      proc = subprocess.Popen([sys.executable, '-m', module, '--config=experiments/configs/digits.py:sync',
                               f'--workdir={workdir}/{module}', *extra], cwd=test_train.ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      time.sleep(after_s)
      self.assertIsNone(proc.poll())
      proc.send_signal(signum)
      _, stderr = proc.communicate(timeout=120)
      last = stderr.strip().splitlines()[-1]
      if after_s < 1.0 or f'preempted by {name} at step' not in stderr:
        self.assertEqual(proc.returncode, status, stderr)
        self.assertRegex(last, f'^stopped by {name} before training started: nothing to save; rerun the same command')
      else:  # in the loop: it checkpointed where it stopped, resumable (75) whichever signal
        self.assertEqual(proc.returncode, preemption.EXIT_PREEMPTED, stderr)
        self.assertRegex(stderr, f'\\npreempted by {name} at step \\d+: checkpoint saved in .*; rerun the same command')
        self.assertRegex(last, '^(preempted by|rerun the same compare command to resume)')
      self.assertNotIn('Traceback', stderr)

  @pytest.mark.slow
  def test_sigterm_to_the_main_exits_75_with_one_line_and_resumes_exactly(self):
    args = ['--config=experiments/configs/digits.py:local_sgd,local_steps=2,num_steps=1500,checkpoint_every=500,'
            'eval_every=250,log_every=50,steps_per_call=1']
    full = self.create_tempdir().full_path
    self.assertEqual(test_train._main(args + [f'--workdir={full}'], timeout=600).returncode, 0)
    stopped = self.create_tempdir().full_path
    proc = subprocess.Popen([sys.executable, '-m', 'waitless.experiments.main', *args, f'--workdir={stopped}'],
                            cwd=test_train.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(metrics_io.read_rows(stopped)) < 3:
      time.sleep(0.05)
    self.assertIsNone(proc.poll(), 'the run finished before it could be stopped; make it longer')
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, preemption.EXIT_PREEMPTED, stderr)
    lines = [line for line in stderr.splitlines() if 'preempted' in line]
    self.assertLen(lines, 1)
    self.assertRegex(lines[0], r'^preempted by SIGTERM at step \d+: checkpoint saved in .*; rerun the same command')
    resumed = test_train._main(args + [f'--workdir={stopped}'], timeout=600)
    self.assertEqual(resumed.returncode, 0, resumed.stderr)
    self.assertEqual(test_train._summary_without_wall(stopped), test_train._summary_without_wall(full))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(stopped)),
                     test_train._strip_wall(metrics_io.read_rows(full)))


if __name__ == '__main__':
  absltest.main()
