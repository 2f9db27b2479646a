"""`experiments.calibrate` interrupted (SIGINT or SIGTERM to its pid): one line, status 130, and every process it
started (the harness's runs, the collectives' processes, and theirs) stopped before its temporary directory goes.

Run: python -m pytest -q tests/experiments/test_calibrate_interrupt.py   (about 40 s on 2 cores)
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _descendants(pid: int) -> set[int]:
  """Every living process below `pid` (by /proc's children lists)."""
  found, todo = set(), [pid]
  while todo:
    p = todo.pop()
    try:
      with open(f'/proc/{p}/task/{p}/children') as f:
        kids = [int(k) for k in f.read().split()]
    except OSError:
      continue
    found.update(kids)
    todo.extend(kids)
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except OSError:
    return False


@pytest.mark.slow
class InterruptTest(parameterized.TestCase):

  @parameterized.parameters(signal.SIGINT, signal.SIGTERM)
  def test_one_line_and_no_child_left(self, sig):
    with tempfile.TemporaryDirectory() as tmp:
      env = dict(os.environ, TMPDIR=tmp)
      proc = subprocess.Popen(
          [sys.executable, '-m', 'waitless.experiments.calibrate', '--config=experiments/configs/digits.py:sync',
           '--processes=2', '--rounds=1', '--repeats=1', '--harness_steps=400', f'--out={tmp}/p.json'],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
      # Wait until the harness runs' processes (grandchildren or deeper) are up: what the bug left running.
      deadline, seen = time.monotonic() + 120, set()
      while time.monotonic() < deadline and proc.poll() is None:
        seen |= _descendants(proc.pid)
        if len(_descendants(proc.pid)) >= 2:
          break
        time.sleep(0.2)
      self.assertIsNone(proc.poll(), 'calibrate ended before its processes started')
      time.sleep(2.0)
      seen |= _descendants(proc.pid)
      os.kill(proc.pid, sig)  # its pid only, not its group
      _, err = proc.communicate(timeout=60)
      self.assertEqual(proc.returncode, 130, err[-2000:])
      lines = [line for line in err.splitlines() if line.strip()]
      self.assertNotIn('Traceback', err)
      self.assertEqual(lines[-1], 'calibrate: interrupted; its processes are stopped and no profile was written')
      left = [pid for pid in seen if _alive(pid)]
      self.assertEqual(left, [], 'processes calibrate started outlived it')
      self.assertEqual([n for n in os.listdir(tmp) if n.startswith('calibrate_')], [])
      self.assertFalse(os.path.exists(f'{tmp}/p.json'))


if __name__ == '__main__':
  absltest.main()
