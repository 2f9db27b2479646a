"""The parameter-server family on real Ray actors (one local Ray for the module, CPU learners): each variant's
run writes an event log whose float64 replay through the sequential parameter server gives the parameters the
server's checkpoint holds; the run's files are those of any run.

Learner 3 really sleeps (`--debug_slow_process`'s slowdown), so the arrivals are stale and out of order. Two
learner processes host two learners each (`ray.learners_per_process=2`, issue 58).
"""

import json
import os
import tempfile
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import events
from waitless.experiments.harness.ray_runtime import pieces
from waitless.experiments.harness.ray_runtime import ray_config
from waitless.experiments.harness.ray_runtime import server as server_lib
from waitless.experiments.harness.ray_runtime import worker
from tests import harness
from tests.algorithms.parameter_server_reference import replay
from tests.experiments.harness.ray_runtime import test_server

SLOW = worker.DebugHooks(slow_learner=3, slow_s=0.02)
TWO_PER_PROCESS = {'ray.learners_per_process': 2}


def setUpModule():
  driver.start_local(num_cpus=2)


def tearDownModule():
  import ray
  ray.shutdown()


def trajectory_from_workdir(config, workdir) -> harness.Trajectory:
  """The replay's view of a finished Ray run: its event log, and the server's state of its last checkpoint (W;
  the views lived in the learners' processes: the replay checks W, which every view's gradient went into)."""
  run = pieces.build(config)
  initial = server_lib.initial_state(run)
  lines = events.read(workdir)
  updates = [events.from_json(line, config.microbatches) for line in lines]
  manager = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  state, _ = manager.restore(manager.latest_step(), initial)
  manager.close()
  state = step_lib.TrainState(*state)
  first = jax.tree.map(lambda x: np.asarray(x)[None], initial.params)
  return harness.Trajectory(run=run, initial_params=first, params=[],
                            positions=[u.positions for u in updates], schedules=[u.schedule for u in updates],
                            losses=np.zeros((len(updates), config.workers)), final_state=state)


class ActorsReplayTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('ksync', 'ksync,k=2', 'ksync'),
      ('kbatch_sync', 'kbatch_sync,k=3', 'kbatch_sync'),
      ('kasync', 'kasync,k=2', 'kasync'),
      ('kbatch_async', 'kbatch_async,k=3', 'kbatch_async'),
      ('async', 'async', 'kbatch_async'),
      ('ringmaster', 'ringmaster,max_delay=2', 'kbatch_async'),
      ('adasync', 'adasync,base=kasync,k0=1,adapt_every_s=0.05', 'kasync'))
  def test_event_log_replays_to_the_checkpointed_parameters(self, arg, variant):
    with jax.enable_x64(True), tempfile.TemporaryDirectory() as workdir:
      config = test_server.f64_config(arg, num_steps=12, eval_every=6, checkpoint_every=6, log_every=3,
                                      **TWO_PER_PROCESS)
      summary = driver.train_and_evaluate(config, workdir, hooks=SLOW)
      traj = trajectory_from_workdir(ray_config.server_config(config), workdir)
      rows = metrics_io.read_rows(workdir)
      with open(os.path.join(workdir, 'summary.json')) as f:
        written = json.load(f)
    self.assertLen(traj.schedules, 12)
    replay(self, traj, ray_config.server_config(config), variant, block=12, restarts=True)
    self.assertEqual([r['step'] for r in rows], [3, 6, 9, 12])
    self.assertTrue(all(r['measured_time'] > 0 and 'sim_time' not in r for r in rows))
    self.assertIn('eval_accuracy', rows[1])
    self.assertEqual(written['steps'], 12)
    self.assertEqual((summary['runtime'], summary['clock']), ('ray', 'measured'))
    self.assertGreater(written['measured_time'], 0.0)


class FailuresTest(parameterized.TestCase):

  def test_a_learner_that_dies_is_restarted_and_the_replay_still_holds(self):
    # Learner 1's process (learners 0 and 1) exits at version 4; Ray restarts it (seconds: a new process imports
    # and compiles), both fetch their views again, the run goes on. Every job takes 0.05 s, so the run outlasts
    # the restart.
    hooks = worker.DebugHooks(delayed_per_job=test_server.P, delay_s=0.05, crash_learner=1, crash_at_version=4)
    with jax.enable_x64(True), tempfile.TemporaryDirectory() as workdir:
      config = test_server.f64_config('async', num_steps=600, eval_every=300, checkpoint_every=300, log_every=50,
                                      **TWO_PER_PROCESS)
      with self.assertLogs('waitless', level='WARNING') as logs:
        summary = driver.train_and_evaluate(config, workdir, hooks=hooks)
      traj = trajectory_from_workdir(ray_config.server_config(config), workdir)
      fetched = [p for line in events.read(workdir) for p in line['pushes'] if p[0] == 1 and p[4] == 'fetched']
    self.assertEqual((summary['steps'], summary['learner_deaths']), (600, 1))
    died = [line for line in logs.output if 'learners 0-1 (process 0) died' in line]  # learner 1's process
    self.assertLen(died, 1)
    self.assertIn('Ray restarts the process', died[0])
    self.assertNotEmpty(fetched, 'the restarted learner did not fetch its view again')
    replay(self, traj, ray_config.server_config(config), 'kbatch_async', block=600, restarts=True)

  @pytest.mark.slow
  def test_a_synchronous_run_names_the_learner_it_lost_and_waits_for_it(self):
    hooks = worker.DebugHooks(crash_learner=2, crash_at_version=3)
    with tempfile.TemporaryDirectory() as workdir:
      config = test_server.f64_config('sync', num_steps=8, **{'model.param_dtype': 'float32', 'model.dtype': 'float32',
                                                              'ray.learners_per_process': 1})
      with self.assertLogs('waitless', level='WARNING') as logs:
        summary = driver.train_and_evaluate(config, workdir, hooks=hooks)
    self.assertEqual((summary['steps'], summary['learner_deaths']), (8, 1))
    died, = [line for line in logs.output if 'died' in line]
    self.assertIn('learner 2 (process 2) died at step 3', died)
    self.assertIn('the synchronous update waits for them', died)

  @pytest.mark.slow
  def test_a_stop_request_checkpoints_and_the_same_call_resumes(self):
    with tempfile.TemporaryDirectory() as workdir:
      config = test_server.f64_config('kasync,k=2', num_steps=400, log_every=10, checkpoint_every=1000,
                                      **{'model.param_dtype': 'float32', 'model.dtype': 'float32'})
      stop = preemption.StopRequests()

      def request_after_first_row():
        deadline = time.time() + 120
        while time.time() < deadline and not os.path.exists(os.path.join(workdir, metrics_io.METRICS_FILE)):
          time.sleep(0.05)
        while time.time() < deadline and not metrics_io.read_rows(workdir):
          time.sleep(0.05)
        stop.request('SIGTERM')

      threading.Thread(target=request_after_first_row, daemon=True).start()
      with self.assertRaises(preemption.Preempted) as stopped:
        driver.train_and_evaluate(config, workdir, stop_requests=stop, hooks=SLOW)
      self.assertLess(stopped.exception.step, 400)
      summary = driver.train_and_evaluate(config, workdir)
      lines = events.read(workdir)
    self.assertEqual(summary['steps'], 400)
    self.assertEqual([line['step'] for line in lines], list(range(1, 401)))


if __name__ == '__main__':
  absltest.main()
