"""Multi-process runs (jax.distributed over loopback, gloo collectives on CPU).

2 processes x 4 CPU devices must reproduce 1 process x 8 devices; a process killed with -9 must stop the
others with an error instead of leaving them waiting in a collective; rerunning the same command must resume
from the last checkpoint and end where an uninterrupted run ends. The settings logic is tested without JAX.

Run: python -m pytest -q tests/experiments/harness/test_multiprocess.py           (all, about 5 minutes on 2 cores)
     python -m pytest -q -m 'not slow' tests/experiments/harness/test_multiprocess.py   (settings only, seconds)
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from waitless import config_errors as errors
from waitless.experiments.harness import distributed
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import peer_watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, 'launch', 'multiprocess_cpu.sh')
SHORT = 'num_steps=20,eval_every=10,checkpoint_every=10,log_every=10'

# The runs whose 2-process version must equal their 1-process version: (test name, config argument).
# A new algorithm is one line here, e.g. ('kasync', 'kasync').
ALGORITHMS = (
    ('sync', 'sync'),
    ('local_sgd', 'local_sgd'),
    # 2 workers vmapped per device, 2 micro-batches: each process feeds 8 workers' micro-batches.
    ('local_sgd_16_workers', 'local_sgd,workers=16,microbatches=2'),
    ('kasync', 'kasync,stragglers.kind=exponential'),
)

# Figures that do not depend on floating-point summation order, compared exactly; the losses and the norm do
# (the cross-process all-reduce over gloo adds in another order than the in-process one): float32 rounding.
EXACT = ('steps', 'sim_time', 'time_to_target', 'num_params', 'final_eval_accuracy')
CLOSE = ('final_train_loss', 'final_eval_loss', 'param_norm')
RTOL, ATOL = 1e-5, 1e-6

# The one line a survivor prints when a peer dies (experiments/harness/peer_watchdog.py), and what it must not print.
PEER_DIED = re.compile(r'^process 0: (process\(es\) 1 stopped responding for 2\.5s \(died or hung\)|a collective '
                       r'failed .*); this process completed step \d+\. The run cannot continue: rerun the same '
                       r'command on every process to resume from the last checkpoint in ', re.MULTILINE)
C_ABORT = re.compile(r'Check failure|\*\*\* SIGABRT|^\s+@\s+0x', re.MULTILINE)


def _env():
  """The test's environment without distributed settings that would turn every run into a multi-process one."""
  env = {k: v for k, v in os.environ.items()
         if k not in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID)}
  env['PYTHONPATH'] = ROOT + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
  env['VIRTUAL_ENV'] = env.get('VIRTUAL_ENV') or os.path.dirname(os.path.dirname(sys.executable))
  env['PYTHON'] = sys.executable
  return env


def _main(args, timeout=300):
  """One process, as before issue 6: no distributed flag."""
  return subprocess.run([sys.executable, '-m', 'waitless.experiments.main', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=_env())


def _launch(processes, args, timeout=300):
  """`launch/multiprocess_cpu.sh processes args...`, waited for."""
  return subprocess.run(['bash', SCRIPT, str(processes), *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env=_env())


def _summary(workdir):
  with open(os.path.join(workdir, 'summary.json')) as f:
    return json.load(f)


def _finished_checkpoints(workdir):
  """Steps of the checkpoints orbax has finalised (unfinished ones carry a tmp suffix)."""
  path = os.path.join(workdir, 'checkpoints')
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _wait_for_checkpoint(workdir, step, procs, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(p.poll() is not None for p in procs):
      return False
    if any(s >= step for s in _finished_checkpoints(workdir)):
      return True
    time.sleep(0.05)
  return False


def _kill(procs):
  """Kills the test's own processes that are still running (by pid)."""
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


class SettingsTest(parameterized.TestCase):
  """Which runs are multi-process, and what they pass to jax.distributed.initialize (no JAX needed)."""

  def test_nothing_set_is_one_process(self):
    self.assertIsNone(distributed.settings_from(environ={}))
    self.assertIsNone(distributed.settings_from(num_processes=1, environ={}))
    self.assertEqual(distributed.initialize(None), 1)

  def test_flags_win_over_the_environment(self):
    env = {distributed.ENV_COORDINATOR: '10.0.0.1:1234', distributed.ENV_NUM_PROCESSES: '4',
           distributed.ENV_PROCESS_ID: '3'}
    self.assertEqual(distributed.settings_from(environ=env),
                     distributed.Settings('10.0.0.1:1234', 4, 3))
    self.assertEqual(distributed.settings_from('127.0.0.1:99', 2, 1, environ=env),
                     distributed.Settings('127.0.0.1:99', 2, 1))

  def test_auto_leaves_the_rest_to_jax_cluster_detection(self):
    self.assertEqual(distributed.settings_from(auto=True, environ={}), distributed.Settings())
    # SLURM / TPU: a process id or a process count alone also asks for a multi-process run.
    self.assertEqual(distributed.settings_from(num_processes=2, environ={}), distributed.Settings(num_processes=2))

  @parameterized.named_parameters(
      ('loopback_ip', '127.0.0.1:1234', True),
      ('localhost', 'localhost:1234', True),
      ('ipv6_loopback', '[::1]:1234', True),
      ('remote', '10.1.2.3:1234', False),
      ('hostname', 'node-001:1234', False),
  )
  def test_loopback(self, address, expected):
    self.assertEqual(distributed.Settings(coordinator_address=address).loopback, expected)

  @parameterized.named_parameters(
      ('no_port', dict(coordinator_address='127.0.0.1'), 'coordinator_address'),
      ('bad_port', dict(coordinator_address='127.0.0.1:x'), 'coordinator_address'),
      ('zero_processes', dict(num_processes=0), 'num_processes'),
      ('id_out_of_range', dict(num_processes=2, process_id=2), 'process_id'),
      ('zero_heartbeat', dict(num_processes=2, heartbeat_timeout_s=0), 'heartbeat_timeout_s'),
  )
  def test_bad_settings_name_the_field(self, kwargs, field):
    with self.assertRaisesRegex(errors.ConfigError, field):
      distributed.settings_from(environ={}, **kwargs)

  def test_bad_environment_value(self):
    with self.assertRaisesRegex(errors.ConfigError, distributed.ENV_NUM_PROCESSES):
      distributed.settings_from(environ={distributed.ENV_NUM_PROCESSES: 'two'})

  def test_devices_split_evenly_over_processes(self):
    self.assertEqual(distributed.host_devices_per_process(8, 1), 8)
    self.assertEqual(distributed.host_devices_per_process(8, 2), 4)
    with self.assertRaisesRegex(errors.ConfigError, 'devices=8 is not allowed: must be a multiple of the 3'):
      distributed.host_devices_per_process(8, 3)

  def test_free_port(self):
    self.assertTrue(0 < distributed.free_port() < 65536)

  def test_script_usage(self):
    result = subprocess.run(['bash', SCRIPT], capture_output=True, text=True, timeout=30, env=_env())
    self.assertEqual(result.returncode, 2)
    self.assertIn('usage:', result.stderr)

  def test_a_bad_split_is_one_line_before_connecting(self):
    result = _main(['--config=experiments/configs/digits.py:sync', '--workdir=/nonexistent/never',
                    '--coordinator_address=127.0.0.1:1', '--num_processes=3', '--process_id=0'], timeout=60)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(result.stderr.strip(),
                     'error: devices=8 is not allowed: must be a multiple of the 3 processes '
                     '(each process holds devices / processes)')


  def test_the_launcher_validates_once_before_starting_processes(self):
    # Issue 39: each process printed the config error, after seconds of start-up, and the launcher ended with
    # "rerun the same command to resume".
    workdir = os.path.join(self.create_tempdir().full_path, 'w')
    for args, message in (
        (['--config=experiments/configs/digits.py:sync', '--config.stragglers.slow_fraction=2'],
         'error: stragglers.slow_fraction=2.0 is not allowed: must be a fraction in [0, 1]'),
        (['--config=experiments/configs/digits.py:sync,devices=3'],
         'error: devices=3 is not allowed: must be a multiple of the 2 processes (each process holds devices / '
         'processes)'),
        (['--config=experiments/configs/digits.py:sync', '--seeds=0'], 'error: --seeds=0 is not allowed: must be '
         'an integer >= 1')):
      result = _launch(2, [*args, f'--workdir={workdir}'], timeout=60)
      self.assertEqual(result.returncode, 2, result.stderr)
      self.assertEqual(result.stderr.strip(), message)
      self.assertNotIn('[multiprocess_cpu] process', result.stdout + result.stderr)
      self.assertFalse(os.path.exists(workdir))

@pytest.mark.slow
class MultiProcessTest(parameterized.TestCase):

  def assertSameSummary(self, workdir, reference):
    """summary.json of `workdir` equals `reference`'s: EXACT keys exactly, CLOSE keys to summation order."""
    expected, got = _summary(reference), _summary(workdir)
    for key in EXACT:
      self.assertEqual(got[key], expected[key], key)
    for key in CLOSE:
      np.testing.assert_allclose(got[key], expected[key], rtol=RTOL, atol=ATOL, err_msg=key)

  @parameterized.named_parameters(*ALGORITHMS)
  def test_two_processes_of_four_devices_equal_one_process_of_eight(self, arg):
    config = f'--config=experiments/configs/digits.py:{arg},{SHORT}'
    one = self.create_tempdir().full_path
    two = self.create_tempdir().full_path
    single = _main([config, f'--workdir={one}'])
    self.assertEqual(single.returncode, 0, single.stderr)
    multi = _launch(2, [config, f'--workdir={two}'])
    self.assertEqual(multi.returncode, 0, multi.stderr[-3000:])
    self.assertIn('[process 1] ', multi.stderr)
    self.assertRegex(multi.stderr, r'\[process 0\] \w+: \d+ workers on 8 cpu device\(s\)')  # one mesh of 8

    self.assertSameSummary(two, one)
    # Process 0 alone writes the metrics: one row per logged step, as in the 1-process run.
    rows, reference = metrics_io.read_rows(two), metrics_io.read_rows(one)
    self.assertEqual([r['step'] for r in rows], [r['step'] for r in reference])
    for row, ref in zip(rows, reference):
      self.assertEqual(set(row), set(ref))
      self.assertEqual(row['sim_time'], ref['sim_time'])
      for key in ('train_loss', 'eval_loss', 'eval_accuracy', 'l2_params', 'l2_grads'):
        if key in ref:
          np.testing.assert_allclose(row[key], ref[key], rtol=RTOL, atol=ATOL, err_msg=f'{key} at {row["step"]}')

  def assertTwoSeedsCheckpointAsOnOneProcess(self, config, checkpoints):
    """`config` with --seeds=2 (replicas) on 1 and on 2 processes: the 2-process run ends without an abort, each
    seed's summary equals its 1-process one and its finished checkpoints are `checkpoints`."""
    one = self.create_tempdir().full_path
    two = self.create_tempdir().full_path
    single = _main([config, '--seeds=2', f'--workdir={one}'])
    self.assertEqual(single.returncode, 0, single.stderr[-3000:])
    multi = _launch(2, [config, '--seeds=2', f'--workdir={two}'], timeout=240)
    self.assertEqual(multi.returncode, 0, multi.stderr[-3000:])
    self.assertNotRegex(multi.stderr, C_ABORT)
    for seed in ('seed0', 'seed1'):
      self.assertSameSummary(os.path.join(two, seed), os.path.join(one, seed))
      self.assertEqual(_finished_checkpoints(os.path.join(two, seed)), checkpoints)

  def test_replicas_checkpoint_on_two_processes(self):
    # Issue 39: the replicas' concurrent saves of one step met at one orbax barrier ("already ongoing", SIGABRT)
    # or hung; each seed must end as it ends on one process.
    self.assertTwoSeedsCheckpointAsOnOneProcess(
        '--config=experiments/configs/digits.py:sync,num_steps=40,checkpoint_every=20,eval_every=20', [20, 40])

  def test_the_wall_clock_checkpoints_are_agreed_on_two_processes(self):
    # checkpoint_every_s: every process must save after the same block (a save is a collective write); a
    # period that has always passed checkpoints after every block, on both processes, and moves no figure.
    self.assertTwoSeedsCheckpointAsOnOneProcess(
        '--config=experiments/configs/digits.py:sync,num_steps=40,checkpoint_every=1000,eval_every=20,'
        'steps_per_call=10,checkpoint_every_s=1e-9', [30, 40])  # the last two of 10, 20, 30, 40

  def test_a_killed_process_stops_the_other_and_a_rerun_resumes(self):
    config = ('--config=experiments/configs/digits.py:sync,num_steps=120,checkpoint_every=20,eval_every=40,'
              'log_every=10,steps_per_call=1')
    reference = self.create_tempdir().full_path
    single = _main([config, f'--workdir={reference}'])
    self.assertEqual(single.returncode, 0, single.stderr)

    workdir = self.create_tempdir().full_path
    port = distributed.free_port()
    logs = [tempfile.TemporaryFile(mode='w+') for _ in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, '-m', 'waitless.experiments.main', config, f'--workdir={workdir}',
         f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}',
         '--heartbeat_timeout_s=5'], cwd=ROOT, stdout=logs[i], stderr=logs[i], env=_env()) for i in range(2)]
    try:
      reached = _wait_for_checkpoint(workdir, 20, procs)
      self.assertTrue(reached and all(p.poll() is None for p in procs),
                      'the run ended before its first checkpoint could be followed by a kill')
      os.kill(procs[1].pid, signal.SIGKILL)
      killed_at = time.time()
      # The processes' own watchdog (no launcher here) must stop process 0, not leave it in a collective.
      rc = procs[0].wait(timeout=120)
      stopped_after = time.time() - killed_at
      procs[1].wait()
    finally:
      _kill(procs)
    logs[0].seek(0)
    survivor_log = logs[0].read()
    self.assertEqual(rc, peer_watchdog.EXIT_PEER_LOST, survivor_log[-3000:])
    self.assertLess(stopped_after, 5)  # within the heartbeat timeout
    self.assertRegex(survivor_log, PEER_DIED)
    self.assertNotRegex(survivor_log, C_ABORT)
    self.assertFalse(os.path.exists(os.path.join(workdir, 'summary.json')))

    resumed = _launch(2, [config, f'--workdir={workdir}'])
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
    self.assertRegex(resumed.stderr, r'Resumed from the checkpoint at step (20|40|60|80|100)')
    self.assertSameSummary(workdir, reference)
    rows, ref_rows = metrics_io.read_rows(workdir), metrics_io.read_rows(reference)
    self.assertEqual([r['step'] for r in rows], [r['step'] for r in ref_rows])
    np.testing.assert_allclose([r['train_loss'] for r in rows], [r['train_loss'] for r in ref_rows],
                               rtol=RTOL, atol=ATOL)

  def test_the_launcher_stops_the_others_when_one_dies(self):
    # A long heartbeat timeout: only the launcher's watchdog can stop process 0 within the test's bound.
    workdir = self.create_tempdir().full_path
    out = tempfile.NamedTemporaryFile(mode='w+', suffix='.log')
    launcher = subprocess.Popen(
        ['bash', SCRIPT, '2', '--config=experiments/configs/digits.py:sync,num_steps=2000,checkpoint_every=10,'
         'eval_every=1000,log_every=10,steps_per_call=1', f'--workdir={workdir}', '--heartbeat_timeout_s=300'],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**_env(), 'GRACE_S': '5'})
    children = []
    try:
      self.assertTrue(_wait_for_checkpoint(workdir, 10, [launcher]), 'the run did not start')
      with open(out.name) as f:
        children = [int(pid) for pid in re.findall(r'process \d+: pid (\d+)', f.read())]
      self.assertLen(children, 2)
      os.kill(children[1], signal.SIGKILL)
      killed_at = time.time()
      rc = launcher.wait(timeout=60)
      stopped_after = time.time() - killed_at
    finally:
      _kill([launcher])
      for pid in children:  # the launcher's own children, should the launcher have failed to stop them
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    with open(out.name) as f:
      text = f.read()
    self.assertEqual(rc, 128 + signal.SIGKILL, text[-3000:])
    self.assertLess(stopped_after, 30)
    self.assertIn(f'process 1 (pid {children[1]}) was killed by signal 9', text)
    self.assertIn('rerun the same command to resume', text)
    with self.assertRaises(ProcessLookupError):
      os.kill(children[0], 0)


if __name__ == '__main__':
  absltest.main()
