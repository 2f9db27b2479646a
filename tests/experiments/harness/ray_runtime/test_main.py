"""`experiments.main` with `runtime=ray`: bad input is one line naming the flag, status 2, before any actor starts
(a Ray address that does not answer is refused within its timeout); kill -9 of the driver resumes from the last
checkpoint."""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
DIGITS = 'experiments/configs/digits.py'


def _command(config_arg, *flags, workdir):
  return [sys.executable, '-m', 'waitless.experiments.main', f'--config={DIGITS}:{config_arg}', f'--workdir={workdir}',
          *flags]


def _main(config_arg, *flags, workdir, timeout=120):
  return subprocess.run(_command(config_arg, *flags, workdir=workdir), cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def _start_until(config_arg, *flags, workdir, written, stderr=subprocess.DEVNULL):
  """A run started in the background, returned once `written(workdir)` holds (at most 180 s)."""
  proc = subprocess.Popen(_command(config_arg, *flags, workdir=workdir), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=stderr, text=True)
  deadline = time.time() + 180
  while time.time() < deadline and not written(workdir):
    time.sleep(0.2)
  return proc


def _has_a_metrics_row(workdir):
  metrics = os.path.join(workdir, 'metrics.jsonl')
  return os.path.exists(metrics) and os.path.getsize(metrics) > 0


def _has_checkpoint(step):
  def has(workdir):
    checkpoints = os.path.join(workdir, 'checkpoints')
    return os.path.isdir(checkpoints) and str(step) in os.listdir(checkpoints)
  return has


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('algorithm_outside_the_family', 'wagma,runtime=ray', (), r'^error: runtime=.ray. .*parameter-server family'),
      ('unknown_runtime', 'async,runtime=mpi', (), r'^error: runtime=.mpi. .*one of spmd, ray'),
      ('slowed_learner_that_does_not_exist', 'async,runtime=ray,workers=4', ('--debug_slow_process=4:0.1',),
       r'^error: debug_slow_process=.4:0.1. .*learner|process I in 0..3'),
      ('crashed_learner_that_does_not_exist', 'async,runtime=ray,workers=4', ('--debug_crash_learner=7:3',),
       r'^error: debug_crash_learner=.7:3. .*learner I in 0..3'),
      ('ray_flag_without_ray', 'async', ('--ray_address=127.0.0.1:6379',),
       r'^error: --ray_address=.* for runtime=ray runs only'),
      ('malformed_address', 'async,runtime=ray', ('--ray_address=garbage',),
       r'^error: --ray_address=garbage is not allowed: must be HOST:PORT'),
      ('address_that_does_not_answer', 'async,runtime=ray', ('--ray_address=127.0.0.1:9',),
       r'^error: --ray_address=127.0.0.1:9 does not answer within'),
      ('more_workers_than_the_cluster_has',
       'async,runtime=ray,workers=4,ray.worker_cpus=8.0,ray.learners_per_process=1', (),
       r'^error: ray.learners_per_process=1 .* need 32 CPUs .*this machine has \d+'),
      # Issue 59: with the default ray.worker_cpus (a share of the CPUs) nothing was ever refused: 64 learners
      # on a 2-core laptop started 64 processes of about 400 MB. Issue 58: a process hosts several learners, so
      # the plan counts processes; one learner per process for 1,024 learners is refused before Ray.
      ('more_processes_than_the_memory_holds',
       'kasync,runtime=ray,workers=1024,batch_size=1,microbatches=1,ray.learners_per_process=1', (),
       r'^error: ray.learners_per_process=1 is not allowed: 1024 learners in 1024 processes of 1 and the server are '
       r'1025 processes of about 0.4 GB each and 1025 models. copies, .* GB in all, more than this machine has '
       r'\(.* GB available, \d+ CPUs\)'))
  def test_one_line_status_2(self, config_arg, flags, pattern):
    workdir = self.create_tempdir().full_path
    start = time.time()
    proc = _main(config_arg, *flags, workdir=workdir)
    errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
    self.assertEqual(proc.returncode, 2, proc.stderr[-2000:])
    self.assertLen(errors, 1, proc.stderr[-2000:])
    self.assertRegex(errors[0], pattern)
    self.assertNotIn('Traceback', proc.stderr)
    self.assertLess(time.time() - start, 60)
    self.assertFalse(os.path.exists(os.path.join(workdir, 'checkpoints')))


class LocalMachineTest(absltest.TestCase):
  """The learner processes against this machine's memory and CPUs, before a local Ray starts (issues 58, 59)."""

  def test_many_learners_share_few_processes_and_a_plan_that_does_not_fit_is_one_line(self):
    from waitless import config_errors
    from waitless.experiments.configs import digits
    from waitless.experiments.harness.ray_runtime import driver
    for workers, per_process in ((64, 32), (256, 128)):  # 2 CPUs: two learner processes (issue 58)
      plan = driver.check_local_machine(digits.get_config(f'kasync,runtime=ray,workers={workers}'), 4e4,
                                        available=24 * 10**9, cpus=2)
      self.assertEqual((plan.processes, plan.per_process), (2, per_process))
      self.assertEqual(sum(plan.groups(), []), list(range(workers)))
    config = digits.get_config('kasync,runtime=ray,workers=64,ray.learners_per_process=1')
    with self.assertRaisesRegex(config_errors.ConfigError, r'^ray.learners_per_process=1 is not allowed: 64 learners '
                                r'in 64 processes of 1 and the server are 65 processes of about 0.4 GB each and 65 '
                                r'models. copies, 26.5 GB in all, more than this machine has \(16 GB available, 2 '
                                r'CPUs\)'):
      driver.check_local_machine(config, 0.0, available=16 * 10**9, cpus=2)
    # A model too big for P learners' copies, whatever the processes: refused naming workers.
    with self.assertRaisesRegex(config_errors.ConfigError, r'^workers=256 is not allowed: 256 learners in 1 process '
                                r'of 256 .* more than this machine has \(16 GB available, 2 CPUs\)'):
      driver.check_local_machine(digits.get_config('kasync,runtime=ray,workers=256'), 1e8, available=16 * 10**9,
                                 cpus=2)
    config = digits.get_config('kasync,runtime=ray,workers=4,ray.worker_cpus=1.0,ray.learners_per_process=1')
    with self.assertRaisesRegex(config_errors.ConfigError, r'^ray.learners_per_process=1 .* need 4 CPUs .* this '
                                r'machine has 2'):
      driver.check_local_machine(config, 0.0, available=16 * 10**9, cpus=2)
    plan = driver.check_local_machine(digits.get_config('kasync,runtime=ray,workers=5,ray.learners_per_process=2'),
                                      0.0, available=16 * 10**9, cpus=2)
    self.assertEqual(plan.groups(), [[0, 1], [2, 3], [4]])


class ClusterPlanTest(absltest.TestCase):
  """A joined Ray cluster's plan is checked against its CPUs, memory and GPUs (`ray.cluster_resources`) before any
  actor starts: one line naming the field, with the figures (issue 58)."""

  def _resources(self, **figures):
    from unittest import mock
    return mock.patch('ray.cluster_resources', return_value=figures)

  def test_a_plan_the_cluster_cannot_place_is_one_line_with_its_figures(self):
    from waitless import config_errors
    from waitless.experiments.configs import digits
    from waitless.experiments.harness.ray_runtime import driver
    with self._resources(CPU=8.0, memory=64e9):
      plan = driver.plan_on_cluster(digits.get_config('async,runtime=ray,workers=64'), 4e4)
      self.assertEqual((plan.processes, plan.per_process), (8, 8))  # the cluster's CPUs, not this machine's
    with self._resources(CPU=8.0, memory=8e9):
      with self.assertRaisesRegex(config_errors.ConfigError, r'^ray.learners_per_process=1 is not allowed: 64 '
                                  r'learners in 64 processes of 1 .* more than the Ray cluster has \(8 GB available, '
                                  r'8 CPUs\)'):
        driver.plan_on_cluster(digits.get_config('async,runtime=ray,workers=64,ray.learners_per_process=1'), 4e4)
    config = digits.get_config('async,runtime=ray,workers=8,ray.worker_gpus=1.0')
    with self._resources(CPU=16.0, GPU=2.0, memory=64e9):
      plan = driver.plan_on_cluster(config, 4e4)
      with self.assertRaisesRegex(config_errors.ConfigError, r'^workers=8 is not allowed: 8 learners in 8 processes '
                                  r'of 1 and the server need 8 GPUs, the Ray cluster has 2'):
        driver.check_resources(config, driver.resources(config, plan.processes), plan)


class LearnerDeathLineTest(absltest.TestCase):
  """Issue 59: the driver's line for a dead learner was cut mid-word ("The task may o)"), and the raylet's own
  "Task ... failed" lines were printed beside it."""

  def test_the_reason_is_cut_at_a_word_never_inside_one(self):
    from waitless.experiments.harness.ray_runtime import driver
    error = RuntimeError('The actor died unexpectedly before finishing this task\n\tclass_name: LearnerActor\n'
                         + 'The worker process has died and the task may or may not have run: ' * 5)
    reason = driver.short_reason(error)
    self.assertLessEqual(len(reason), 160)
    self.assertTrue(reason.endswith('...'), reason)
    self.assertIn(reason[:-3].rsplit(' ', 1)[-1], error.args[0].split())  # the last word is whole
    self.assertEqual(driver.short_reason(RuntimeError('Short. Second sentence.')), 'Short')
    self.assertEqual(driver.short_reason(RuntimeError()), 'RuntimeError')

  def test_the_raylets_messages_go_to_the_workdir(self):
    import contextlib
    import io
    from ray._private import worker as ray_worker
    from waitless.experiments.harness.ray_runtime import driver
    path = os.path.join(self.create_tempdir().full_path, driver.RAYLET_MESSAGES)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      with driver.raylet_messages_to(path):
        ray_worker.print_to_stdstream({'lines': ['Task LearnerActor.work failed.'], 'pid': 'raylet',
                                       'is_err': False}, ignore_prefix=False)
    self.assertEqual(out.getvalue(), '')
    self.assertRegex(open(path).read(), r'^\d\d:\d\d:\d\d Task LearnerActor.work failed.\n$')


class ClusterTest(absltest.TestCase):

  @pytest.mark.slow
  def test_joins_a_running_cluster_and_leaves_it_running(self):
    # The cluster's token reaches the driver the way Ray's docs say: RAY_AUTH_TOKEN in its environment.
    port, env = 26379, {**os.environ, 'RAY_AUTH_MODE': 'token', 'RAY_AUTH_TOKEN': secrets.token_hex(16)}
    head = subprocess.Popen(['ray', 'start', '--head', f'--port={port}', '--num-cpus=2', '--include-dashboard=false',
                             '--block'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
      workdir = self.create_tempdir().full_path
      proc = subprocess.run(_command('kasync,k=2,runtime=ray,workers=4,num_steps=30', f'--ray_address=127.0.0.1:{port}',
                                     workdir=workdir), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
      self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
      with open(os.path.join(workdir, 'summary.json')) as f:
        self.assertEqual(json.load(f)['steps'], 30)
      self.assertIsNone(head.poll(), 'the run stopped the cluster it joined')
    finally:
      head.send_signal(signal.SIGTERM)
      head.wait(timeout=60)


class KillTest(absltest.TestCase):

  @pytest.mark.slow
  def test_sigterm_checkpoints_exits_75_and_the_rerun_resumes(self):
    # Ray installs a SIGTERM handler of its own at start; the run's must stay the one that answers.
    workdir = self.create_tempdir().full_path
    arg = 'async,runtime=ray,workers=4,num_steps=3000,checkpoint_every=100000,eval_every=1000'
    flags = ('--debug_slow_process=3:0.01',)
    proc = _start_until(arg, *flags, workdir=workdir, written=_has_a_metrics_row, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 75, stderr[-2000:])
    self.assertRegex(stderr, r'preempted by SIGTERM at step \d+')
    resumed = _main(arg, *flags, workdir=workdir, timeout=300)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-2000:])
    with open(os.path.join(workdir, 'events.jsonl')) as f:
      self.assertEqual([json.loads(line)['step'] for line in f], list(range(1, 3001)))

  @pytest.mark.slow
  def test_kill_9_of_the_driver_resumes_from_the_last_checkpoint(self):
    workdir = self.create_tempdir().full_path
    arg = 'async,runtime=ray,workers=4,num_steps=3000,checkpoint_every=300,eval_every=1000'
    flags = ('--debug_slow_process=3:0.01',)
    proc = _start_until(arg, *flags, workdir=workdir, written=_has_checkpoint(300))
    checkpoints = os.path.join(workdir, 'checkpoints')
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    self.assertIn('300', os.listdir(checkpoints))
    resumed = _main(arg, *flags, workdir=workdir, timeout=300)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-2000:])
    self.assertRegex(resumed.stderr, r'Resumed from the checkpoint at step [1-9]\d*00 ')
    with open(os.path.join(workdir, 'summary.json')) as f:
      self.assertEqual(json.load(f)['steps'], 3000)
    with open(os.path.join(workdir, 'events.jsonl')) as f:
      steps = [json.loads(line)['step'] for line in f]
    self.assertEqual(steps, list(range(1, 3001)))


def _learner_processes(driver_pid):
  """The driver's local Ray's learner processes (its descendants that Ray titles ray::LearnerActor...)."""
  import psutil
  found = []
  for proc in psutil.Process(driver_pid).children(recursive=True):
    try:
      if proc.cmdline() and proc.cmdline()[0].startswith('ray::LearnerActor'):
        found.append(proc)
    except psutil.Error:
      pass
  return found


def _metrics_steps(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line)['step'] for line in f if line.strip()]


class FaultsAtScaleTest(parameterized.TestCase):
  """Issue 58: at P = 64 a learner process hosts 16 learners (ray.learners_per_process); kill -9 of one restarts
  its learners and the run completes; SIGTERM of the driver checkpoints and the rerun resumes with contiguous
  metrics and event log. P = 8 (two processes of 4) is the same test, smaller; both start a local Ray and its
  processes twice or more (tens of seconds): slow. Every job sleeps `delay` (--debug_delay=P:S, every learner
  every job), so that the run outlasts a process's restart (it imports JAX and compiles again: seconds)."""

  @parameterized.named_parameters(('8_learners', 8, 4, 0.01, 2500), ('64_learners', 64, 16, 0.02, 4000))
  @pytest.mark.slow
  def test_kill_9_of_a_learner_process_restarts_its_learners_and_the_run_completes(self, workers, per_process,
                                                                                   delay, steps):
    workdir = self.create_tempdir().full_path
    arg = (f'async,runtime=ray,workers={workers},ray.learners_per_process={per_process},num_steps={steps},'
           f'eval_every={steps},checkpoint_every=100000,log_every=100,optimizer.learning_rate=0.005')
    flags = (f'--debug_delay={workers}:{delay}',)
    proc = _start_until(arg, *flags, workdir=workdir, written=_has_a_metrics_row, stderr=subprocess.PIPE)
    learners = _learner_processes(proc.pid)
    self.assertLen(learners, workers // per_process)
    learners[0].kill()  # SIGKILL
    _, stderr = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 0, stderr[-2000:])
    died = re.findall(r'learners (\d+)-(\d+) \(process \d+\) died at step \d+ .*Ray restarts the process', stderr)
    self.assertLen(died, 1, stderr[-2000:])
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
    self.assertEqual((summary['steps'], summary['learner_deaths']), (steps, 1))
    with open(os.path.join(workdir, 'events.jsonl')) as f:
      lines = [json.loads(line) for line in f]
    self.assertEqual([line['step'] for line in lines], list(range(1, steps + 1)))
    first, last = int(died[0][0]), int(died[0][1])
    fetched = {p[0] for line in lines for p in line['pushes'] if p[4] == 'fetched'}
    self.assertEqual(set(range(first, last + 1)) - fetched, set(), 'a restarted learner did not fetch its view')

  @parameterized.named_parameters(('8_learners', 8, 4), ('64_learners', 64, 16))
  @pytest.mark.slow
  def test_sigterm_of_the_driver_checkpoints_and_the_rerun_resumes_with_contiguous_logs(self, workers,
                                                                                         per_process):
    workdir = self.create_tempdir().full_path
    steps = 3000
    arg = (f'kasync,k=4,runtime=ray,workers={workers},ray.learners_per_process={per_process},num_steps={steps},'
           'eval_every=1000,checkpoint_every=100000,log_every=50,optimizer.learning_rate=0.005')
    flags = (f'--debug_delay={workers}:0.005',)
    proc = _start_until(arg, *flags, workdir=workdir, written=_has_a_metrics_row, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 75, stderr[-2000:])
    stopped = int(re.search(r'preempted by SIGTERM at step (\d+)', stderr).group(1))
    self.assertLess(stopped, steps)
    resumed = _main(arg, *flags, workdir=workdir, timeout=300)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-2000:])
    self.assertRegex(resumed.stderr, rf'Resumed from the checkpoint at step {stopped}\b')
    with open(os.path.join(workdir, 'events.jsonl')) as f:
      self.assertEqual([json.loads(line)['step'] for line in f], list(range(1, steps + 1)))
    logged = _metrics_steps(workdir)
    self.assertEqual([s for s in logged if s % 50 == 0], list(range(50, steps + 1, 50)))
    self.assertEqual(logged, sorted(set(logged)))  # a row per step at most, in order


if __name__ == '__main__':
  absltest.main()
