"""The parameter-server family on real Ray actors (one local Ray for the module, CPU learners): each variant's
run writes an event log whose float64 replay through the sequential parameter server gives the parameters the
server's checkpoint holds; the run's files are those of any run.

Learner 3 really sleeps (`--debug_slow_process`'s slowdown), so the arrivals are stale and out of order.
"""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import events
from waitless.experiments.harness.ray_runtime import pieces
from waitless.experiments.harness.ray_runtime import ray_config
from waitless.experiments.harness.ray_runtime import worker
from tests import harness
from tests.algorithms.parameter_server_reference import replay
from tests.experiments.harness.ray_runtime import test_server

SLOW = worker.Slowdown(slow_learner=3, slow_s=0.02)


def setUpModule():
  import ray  # pylint: disable=g-import-not-at-top
  ray.init(num_cpus=2, include_dashboard=False, logging_level='ERROR')


def tearDownModule():
  import ray  # pylint: disable=g-import-not-at-top
  ray.shutdown()


def trajectory_from_workdir(config, workdir) -> harness.Trajectory:
  """The replay's view of a finished Ray run: its event log, and the state of its last checkpoint."""
  run = pieces.build(config)
  initial = jax.device_get(setup.init_state(run))
  lines = events.read(workdir)
  updates = [events.from_json(line, config.microbatches) for line in lines]
  manager = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  state, _ = manager.restore(manager.latest_step(), initial)
  manager.close()
  state = step_lib.TrainState(*state)
  return harness.Trajectory(run=run, initial_params=initial.params, params=[jax.device_get(state.params)],
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
      config = test_server.f64_config(arg, num_steps=12, eval_every=6, checkpoint_every=6, log_every=3)
      summary = driver.train_and_evaluate(config, workdir, slowdown=SLOW)
      traj = trajectory_from_workdir(ray_config.server_config(config), workdir)
      rows = metrics_io.read_rows(workdir)
      with open(os.path.join(workdir, 'summary.json')) as f:
        written = json.load(f)
    self.assertLen(traj.schedules, 12)
    replay(self, traj, ray_config.server_config(config), variant, block=12, restarts=True)
    self.assertEqual([r['step'] for r in rows], [3, 6, 9, 12])
    self.assertTrue(all(r['clock'] == 'measured' and r['runtime'] == 'ray' for r in rows))
    self.assertIn('eval_accuracy', rows[1])
    self.assertEqual(written['steps'], 12)
    self.assertEqual(summary['runtime'], 'ray')
    self.assertGreater(written['measured_time'], 0.0)


if __name__ == '__main__':
  absltest.main()
