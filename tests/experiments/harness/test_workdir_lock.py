"""One program at a time per workdir: a second stops before training, in one line naming the holder."""

import os
import subprocess
import sys

from absl.testing import absltest

from waitless.experiments.harness import train
from waitless.experiments.harness import workdir_lock
from tests import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class WorkdirLockTest(absltest.TestCase):

  def test_a_held_workdir_is_refused_naming_the_holder_and_free_after_release(self):
    workdir = self.create_tempdir().full_path
    held = workdir_lock.WorkdirLock(workdir)
    with self.assertRaisesRegex(workdir_lock.WorkdirBusy, rf'^workdir {workdir} is in use by pid {os.getpid()} on '
                                r'\S+ since [\d-]+ [\d:]+ \(.*\): wait for it to finish, stop it, or use another'):
      workdir_lock.WorkdirLock(workdir)
    held.release()
    workdir_lock.WorkdirLock(workdir).release()  # free again (the stale file does not block)

  def test_a_second_training_of_a_held_workdir_stops_before_training(self):
    workdir = self.create_tempdir().full_path
    held = workdir_lock.WorkdirLock(workdir)
    config = harness.synthetic_config('sync', num_steps=4, checkpoint_every=2)
    with self.assertRaises(workdir_lock.WorkdirBusy):
      train.train_and_evaluate(config, workdir)
    self.assertFalse(os.path.exists(os.path.join(workdir, 'checkpoints')))
    held.release()
    train.train_and_evaluate(config, workdir)
    self.assertTrue(os.path.exists(os.path.join(workdir, 'summary.json')))

  def test_a_second_comparison_on_a_held_workdir_is_one_line_and_status_2(self):
    # Issue 39: two comparisons on one workdir trained every run twice and wrote duplicate event files.
    root = self.create_tempdir().full_path
    held = workdir_lock.WorkdirLock(root)
    result = subprocess.run([sys.executable, '-m', 'waitless.experiments.compare',
                             '--config=experiments/configs/digits.py', '--algorithms=sync', f'--workdir={root}',
                             '--config.num_steps=2'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    held.release()
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertRegex(result.stderr.strip().splitlines()[-1], rf'^error: workdir {root} is in use by pid {os.getpid()}')
    self.assertNotIn('Traceback', result.stderr)
    self.assertFalse(os.path.exists(os.path.join(root, 'sync')))


if __name__ == '__main__':
  absltest.main()
