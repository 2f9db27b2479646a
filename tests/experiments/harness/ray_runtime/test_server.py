"""The Ray runtime's server applies each variant's own update to real arrival orders: a float64 replay of its
event records through the sequential parameter server gives the same views and server model.

The arrivals come from `in_process.run` (the server and learners in one process, arrival order from seeded
compute times, one learner four times slower): the actors' protocol without processes. The same replay of a
run on real Ray actors is in test_actors.py.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.experiments.harness.ray_runtime import arrivals
from waitless.experiments.harness.ray_runtime import ray_config
from tests import harness
from tests.algorithms.parameter_server_reference import replay
from tests.experiments.harness.ray_runtime import in_process

P = 4
MEANS = (1.0, 1.0, 1.0, 4.0)  # learner 3 is slow


def f64_config(arg, **overrides):
  return harness.synthetic_config(arg, **{
      'model.param_dtype': 'float64', 'model.dtype': 'float64', 'workers': P, 'devices': 1, 'num_steps': 14,
      'runtime': 'ray', **overrides})


# (config argument, the variant whose replay rules apply, overrides)
CASES = (
    ('ksync', 'ksync,k=2', 'ksync', {}),
    ('ksync_momentum_microbatches', 'ksync,k=3', 'ksync', {'optimizer.momentum': 0.9, 'microbatches': 2}),
    ('sync_as_ksync', 'sync', 'ksync', {}),
    ('kbatch_sync', 'kbatch_sync,k=3', 'kbatch_sync', {}),
    ('kasync', 'kasync,k=2', 'kasync', {}),
    ('kasync_adaptive_lr', 'kasync,k=1,adaptive_lr_c=1e-4,eta_max=0.08', 'kasync', {}),
    ('kbatch_async', 'kbatch_async,k=3', 'kbatch_async', {'microbatches': 2, 'optimizer.momentum': 0.9}),
    ('async', 'async', 'kbatch_async', {}),
    ('ringmaster', 'ringmaster,max_delay=2', 'kbatch_async', {}),
    ('adasync_ksync', 'adasync,base=ksync,k0=1,adapt_every_s=2.0', 'ksync', {'num_steps': 30}),
    ('adasync_kbatch_async', 'adasync,base=kbatch_async,k0=1,adapt_every_s=1.0', 'kbatch_async', {'num_steps': 30}),
)


class ServerReplayTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_replay_gives_the_same_parameters(self, arg, variant, overrides):
    with jax.enable_x64(True):
      config = f64_config(arg, **overrides)
      server, initial, learners = in_process.run(config, MEANS)
      traj = in_process.trajectory(server, initial, learners)
    self.assertLen(traj.schedules, config.num_steps)
    replay(self, traj, ray_config.server_config(config), variant, block=len(traj.schedules), restarts=True)
    staleness = max(int(s.staleness.max()) for s in traj.schedules)
    discarded = sum(p.outcome == arrivals.DISCARDED for r in server.records for p in r.pushes)
    if variant in ('kasync', 'kbatch_async') and 'max_delay' not in arg:
      self.assertGreater(staleness, 0, 'no stale gradient: the replay would not exercise views')
    if variant in ('ksync', 'kbatch_sync') and config.algorithm.get('k', P) < P:
      self.assertGreater(discarded, 0, 'no cancelled job arrived: the test would not exercise discarding')
    if 'max_delay' in arg:
      self.assertTrue(any(s.discarded.any() for s in traj.schedules), 'Ringmaster discarded nothing')
      self.assertLess(staleness, config.algorithm.max_delay)
    if arg.startswith('adasync'):
      self.assertGreater(max(int(s.k) for s in traj.schedules), 1, 'K never adapted')

  @parameterized.named_parameters(
      ('kasync', 'kasync,k=2', 'kasync'), ('kasync_adaptive_lr', 'kasync,k=2,adaptive_lr_c=1e-4', 'kasync'),
      ('kbatch_async', 'kbatch_async,k=2', 'kbatch_async'), ('ksync', 'ksync,k=2', 'ksync'))
  def test_learners_that_start_late_fetch_the_current_model(self, arg, variant):
    # Real learners start when their actor is up: after some updates. Their first fetch is an event.
    with jax.enable_x64(True):
      config = f64_config(arg)
      server, initial, learners = in_process.run(config, MEANS, starts=(0.0, 0.0, 3.0, 6.0))
      traj = in_process.trajectory(server, initial, learners)
    fetched = [p for r in server.records for p in r.pushes if p.outcome == arrivals.FETCHED]
    if variant == 'ksync':  # fresh views: every view is W_t already, a fetch changes none
      self.assertEmpty(fetched)
    else:
      self.assertNotEmpty(fetched)
      self.assertTrue(all(p.version > 0 for p in fetched))
    replay(self, traj, ray_config.server_config(config), variant, block=len(traj.schedules), restarts=True)

  def test_sync_runs_as_ksync_with_k_equal_to_workers(self):
    config = ray_config.server_config(f64_config('sync'))
    self.assertEqual((config.algorithm.name, config.algorithm.k, config.devices), ('ksync', P, 1))


class ArrivalsTest(parameterized.TestCase):
  """The table of arrivals.py, push by push."""

  def test_ksync_discards_a_push_of_an_older_version_and_moves_no_data(self):
    a = arrivals.Arrivals(P, 2, arrivals.Policy(current_only=True, waits=True), k=2)
    self.assertEqual(a.push(0, 0, 0).outcome, arrivals.TAKEN)
    self.assertEqual(a.push(1, 0, 0).outcome, arrivals.TAKEN_LAST)
    update = a.close_update()
    np.testing.assert_array_equal(update.schedule.contributions, [1, 1, 0, 0])
    self.assertTrue(update.schedule.refresh_view.all())
    late = a.push(2, 0, 0)
    self.assertEqual((late.outcome, late.delay), (arrivals.DISCARDED, 1))
    np.testing.assert_array_equal(a.positions, [2, 2, 0, 0])

  def test_kbatch_async_marks_views_and_ringmaster_discards_at_its_threshold(self):
    a = arrivals.Arrivals(P, 1, arrivals.Policy(current_only=False, waits=False, max_delay=2), k=2)
    for learner in (0, 1):
      a.push(learner, 0, 0)
    a.close_update()
    for learner in (0, 1):
      a.push(learner, 1, 1)
    a.close_update()
    self.assertEqual(a.push(2, 0, 0).outcome, arrivals.DISCARDED)  # delay 2 >= R
    self.assertEqual(a.push(0, 2, 2).outcome, arrivals.TAKEN)
    self.assertEqual(a.push(2, 2, 0).outcome, arrivals.TAKEN_LAST)  # restarted on W_t, pushes in the same update
    s = a.close_update().schedule
    np.testing.assert_array_equal(s.discarded, [False, False, True, False])
    np.testing.assert_array_equal(s.refresh_view, [False, False, True, False])
    np.testing.assert_array_equal(s.fetch_current, [True, False, False, False])

  def test_protocol_errors_name_the_learner(self):
    a = arrivals.Arrivals(P, 1, arrivals.Policy(current_only=False, waits=False), k=1)
    with self.assertRaisesRegex(ValueError, 'learner 1 .* position 5'):
      a.push(1, 0, 5)
    with self.assertRaisesRegex(ValueError, 'learner 1 .* version 3'):
      a.push(1, 3, 0)


if __name__ == '__main__':
  absltest.main()
