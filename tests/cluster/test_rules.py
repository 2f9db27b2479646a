"""Time rules: analytic cases, schedule contracts, failures, AdaSync feedback, exact resume."""

import json
import math

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import adasync
from waitless.cluster.rules import dasgd
from waitless.cluster.rules import dpsgd
from waitless.cluster.rules import kasync
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from waitless.cluster.rules import ksync
from waitless.cluster.rules import lap_sgd
from waitless.cluster.rules import local_sgd
from waitless.cluster.rules import nonblocking
from waitless.cluster.rules import sync
from waitless.algorithms import wagma
from waitless.cluster.rules import wagma as wagma_rule
from waitless.cluster import clock as clock_lib
from waitless.cluster import schedules
from tests.cluster import helpers

X = 0.01   # constant seconds per micro-batch
M = 2      # micro-batches per mini-batch
P = 8
NET = {'kind': 'alpha_beta', 'latency_s': 1e-4, 'bandwidth_gbps': 1.0}


def every(h):
  return lambda t: (t + 1) % h == 0


# name, rule factory, mean iteration time with no stragglers and an ideal network.
NO_STRAGGLER_CASES = (
    ('barrier', lambda: sync.Barrier(M), M * X),
    ('periodic_average', lambda: local_sgd.PeriodicAverage(every(4), M), M * X),
    ('ring_gossip', lambda: dpsgd.RingGossip(M), M * X),
    ('ring_gossip_overlap', lambda: dpsgd.RingGossip(M, order='overlap'), M * X),
    ('nonblocking_fastest', lambda: nonblocking.NonBlocking(M), M * X),
    ('nonblocking_deadline', lambda: nonblocking.NonBlocking(M, trigger='deadline', deadline_s=1.0), M * X),
    ('ksync', lambda: ksync.KSync(3, M), M * X),
    ('kbatch_sync', lambda: kbatch_sync.KBatchSync(3, M), M * X),
    ('kasync_k_equals_p', lambda: kasync.KAsync(P, M), M * X),
    ('kasync_k4', lambda: kasync.KAsync(4, M), M * X * 4 / P),  # K divides P: P/K updates per X, nobody waits
    ('kbatch_async_k_equals_p', lambda: kbatch_async.KBatchAsync(P, M), M * X),
    ('kbatch_async_k4', lambda: kbatch_async.KBatchAsync(4, M), M * X * 4 / P),  # P pushes per X: K/P of X each
    ('adasync', lambda: adasync.AdaSync(ksync.KSync(1, M), k0=2, period_s=0.05), M * X),
    ('dasgd', lambda: dasgd.DelayedAverage(4, 1, M), M * X),
    ('lap_sgd', lambda: lap_sgd.NodeThreads(4, every(16), M), M * X),
    ('wagma', lambda: wagma_rule.WaitAvoidingGroups(4, 4, M), M * X),
    ('wagma_step_then_average', lambda: wagma_rule.WaitAvoidingGroups(4, 4, M, rule='step_then_average'), M * X),
)

# Every rule with stragglers of every sort, for the resume and fast-path tests.
ALL_RULES = NO_STRAGGLER_CASES + (
    ('nonblocking_ring', lambda: nonblocking.NonBlocking(3, topology='ring'), None),
    ('adasync_kasync', lambda: adasync.AdaSync(kasync.KAsync(1), k0=2, period_s=0.01), None),
    ('adasync_kbatch_async', lambda: adasync.AdaSync(kbatch_async.KBatchAsync(1), k0=2, period_s=0.01), None),
    ('dasgd_d0', lambda: dasgd.DelayedAverage(3, 0), None),
    ('lap_sgd_fixed_delay', lambda: lap_sgd.NodeThreads(2, every(2), delay_steps=3), None),
)


class NoStragglerTest(parameterized.TestCase):
  """No stragglers, free network: every rule reduces to its barrier time (one mini-batch per iteration)."""

  @parameterized.named_parameters(*NO_STRAGGLER_CASES)
  def test_iteration_time(self, make_rule, expected):
    clock = helpers.clock(make_rule(), workers=P, base_s=X)
    block = clock.next_block(64)
    np.testing.assert_allclose(block.sim_time[-1] / 64, expected, rtol=1e-9)
    self.assertTrue(np.all(np.diff(block.sim_time) >= 0))
    self.assertEqual(block.schedule.microbatches_done.shape, (64, P))
    self.assertEqual(block.schedule.microbatches_done.dtype, np.int32)
    uniform = schedules.uniform_fields(type(block.schedule))
    for key, value in block.schedule._asdict().items():
      self.assertEqual(value.shape, (64,) if key in uniform else (64, P), key)
    if not isinstance(clock.rule, (ksync.KSync, kbatch_sync.KBatchSync, kasync.KAsync, kbatch_async.KBatchAsync,
                                   adasync.AdaSync, nonblocking.NonBlocking)):
      np.testing.assert_array_equal(block.schedule.microbatches_done, M)
    np.testing.assert_allclose(block.idle, 0.0, atol=1e-12)
    np.testing.assert_array_equal(block.mean_staleness[:1], 0.0)

  def test_barrier_with_network(self):
    clock = helpers.clock(sync.Barrier(M), workers=P, base_s=X, network=NET)
    block = clock.next_block(10)
    expected = M * X + clock.network.allreduce(clock.model_bytes, P)
    np.testing.assert_allclose(block.duration, expected, rtol=1e-12)
    np.testing.assert_allclose(block.bytes_communicated, 2 * (P - 1) * clock.model_bytes)

  def test_ksync_with_network_pays_push_and_fetch(self):
    clock = helpers.clock(ksync.KSync(2, M), workers=P, base_s=X, network=NET)
    block = clock.next_block(10)
    np.testing.assert_allclose(block.duration, M * X + 2 * clock.network.p2p(clock.model_bytes), rtol=1e-12)
    np.testing.assert_array_equal(block.schedule.contributions.astype(bool).sum(axis=1), 2)

  def test_ring_gossip_with_network(self):
    clock = helpers.clock(dpsgd.RingGossip(M), workers=P, base_s=X, network=NET)
    block = clock.next_block(10)
    np.testing.assert_allclose(block.duration, M * X + 2 * clock.network.p2p(clock.model_bytes), rtol=1e-12)


class RingGossipTest(absltest.TestCase):

  def test_waits_only_for_neighbours(self):
    # Worker 0 is 3x slower; worker 4 is two hops from both of its neighbours' neighbours... of worker 0.
    clock = helpers.clock(dpsgd.RingGossip(), workers=P, base_s=X, slow_workers=(0,), slow_factor=3.0)
    clock.next_block(1)
    np.testing.assert_allclose(clock.times[[7, 0, 1]], 3 * X)
    np.testing.assert_allclose(clock.times[[3, 4, 5]], X)
    clock.next_block(1)  # the delay spreads one hop per iteration
    np.testing.assert_allclose(clock.times[[6, 2]], 4 * X)
    np.testing.assert_allclose(clock.times[4], 2 * X)


class NonBlockingTest(absltest.TestCase):

  def test_fastest_trigger_partial_work_and_abandoned_microbatch(self):
    clock = helpers.clock(nonblocking.NonBlocking(3), workers=4, base_s=X, slow_workers=(0,), slow_factor=2.5)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [1, 3, 3, 3])
    np.testing.assert_array_equal(block.schedule.abandoned[0], [True, False, False, False])
    # min_i (time to finish m) + the news's one hop from worker 1 to worker 0 + free all-reduce
    np.testing.assert_allclose(block.duration, 3 * X + clock.rule.activation_latency_s, rtol=1e-12)
    # The abandoned micro-batch was started, so the compute trace moved past it; its data was not consumed.
    np.testing.assert_array_equal(clock.units, [2, 3, 3, 3])

  def test_deadline_trigger(self):
    rule = nonblocking.NonBlocking(3, trigger='deadline', deadline_s=0.015)
    clock = helpers.clock(rule, workers=4, base_s=X, slow_workers=(0,), slow_factor=2.0)
    block = clock.next_block(2)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [0, 1, 1, 1])
    np.testing.assert_allclose(block.duration, 0.015)

  def test_deadline_never_ends_empty(self):
    rule = nonblocking.NonBlocking(2, trigger='deadline', deadline_s=1e-4)
    block = helpers.clock(rule, workers=4, base_s=X).next_block(3)
    np.testing.assert_array_equal(block.schedule.microbatches_done, 1)
    np.testing.assert_allclose(block.duration, X)


class ParameterServerTest(absltest.TestCase):

  def test_kbatch_sync_fast_learner_gives_several(self):
    clock = helpers.clock(kbatch_sync.KBatchSync(4), workers=4, base_s=X, slow_workers=(0,), slow_factor=10.0)
    block = clock.next_block(3)
    np.testing.assert_array_equal(block.schedule.contributions, [[0, 2, 1, 1]] * 3)
    np.testing.assert_array_equal(block.schedule.microbatches_done, [[0, 2, 1, 1]] * 3)
    np.testing.assert_allclose(block.duration, 2 * X)

  def test_async_staleness_and_views(self):
    block = helpers.clock(kbatch_async.KBatchAsync(1), workers=2, base_s=X).next_block(6)
    # Both learners finish at X, 2X, ...; the server takes one gradient per update, lowest id first.
    np.testing.assert_array_equal(block.schedule.contributions, [[1, 0], [0, 1]] * 3)
    np.testing.assert_array_equal(block.schedule.staleness.sum(axis=1), [0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(block.schedule.refresh_view, block.schedule.contributions > 0)
    self.assertFalse(block.schedule.fetch_current.any())
    np.testing.assert_allclose(block.sim_time, [X, X, 2 * X, 2 * X, 3 * X, 3 * X])

  def test_kbatch_async_contributions_sum_to_k(self):
    rule = kbatch_async.KBatchAsync(3)
    block = helpers.clock(rule, workers=P, kind='exponential', rate=50.0, slow_workers=(1, 2),
                          slow_factor=5.0).next_block(500)
    np.testing.assert_array_equal(block.schedule.contributions.sum(axis=1), 3)
    both = block.schedule.fetch_current & block.schedule.refresh_view
    self.assertFalse(both.any())
    np.testing.assert_array_equal(block.schedule.refresh_view.sum(axis=1), 1)
    np.testing.assert_array_equal(block.idle, 0.0)

  def test_kasync_staleness_counts_server_versions(self):
    # Worker 0 is 2.5x slower: each of its gradients is 2 or 3 server versions old (K = 2 of 3).
    clock = helpers.clock(kasync.KAsync(2), workers=3, base_s=X, slow_workers=(0,), slow_factor=2.5)
    block = clock.next_block(40)
    np.testing.assert_array_equal(block.schedule.contributions.astype(bool).sum(axis=1), 2)
    np.testing.assert_array_equal(block.schedule.refresh_view, block.schedule.contributions.astype(bool))
    slow = block.schedule.staleness[block.schedule.contributions.astype(bool)[:, 0], 0]
    self.assertGreater(len(slow), 5)
    self.assertTrue(np.all(slow >= 1))
    np.testing.assert_array_equal(block.schedule.staleness[~block.schedule.contributions.astype(bool)], 0)

  def test_set_k(self):
    clock = helpers.clock(ksync.KSync(2), workers=4, base_s=X)
    clock.next_block(1)
    clock.set_k(3)
    block = clock.next_block(2)
    np.testing.assert_array_equal(block.schedule.k, 3)
    np.testing.assert_array_equal(block.schedule.contributions.astype(bool).sum(axis=1), 3)
    with self.assertRaises(ValueError):
      clock.set_k(5)
    with self.assertRaises(TypeError):
      helpers.clock(sync.Barrier(), workers=4).set_k(2)


class AdaSyncTest(absltest.TestCase):

  def test_k_follows_the_loss_every_period(self):
    rule = adasync.AdaSync(ksync.KSync(1), k0=2, period_s=0.05)
    clock = helpers.clock(rule, workers=P, base_s=X)
    clock.feedback(train_loss=1.0)                 # F(W_0)
    block = clock.next_block(5)                    # t = 0 .. 0.05: K0
    np.testing.assert_array_equal(block.schedule.k, 2)
    clock.feedback(train_loss=0.25)                # K = round(2 sqrt(1 / 0.25)) = 4 from t = 0.05
    block = clock.next_block(5)
    np.testing.assert_array_equal(block.schedule.k, 4)
    np.testing.assert_array_equal(block.schedule.contributions.astype(bool).sum(axis=1), 4)
    clock.feedback(train_loss=1e-4)                # capped at P
    block = clock.next_block(5)
    np.testing.assert_array_equal(block.schedule.k, P)

  def test_k_waits_for_the_period(self):
    clock = helpers.clock(adasync.AdaSync(kasync.KAsync(1), k0=1, period_s=1.0), workers=P, base_s=X)
    clock.feedback(train_loss=1.0)
    clock.next_block(2)
    clock.feedback(train_loss=0.01)
    np.testing.assert_array_equal(clock.next_block(10).schedule.k, 1)

  def test_no_loss_keeps_k0(self):
    clock = helpers.clock(adasync.AdaSync(ksync.KSync(1), k0=3, period_s=0.01), workers=P, base_s=X)
    np.testing.assert_array_equal(clock.next_block(10).schedule.k, 3)


class DelayedAverageTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('d1', 1, [4, 8], [1, 1], [3, 7, 11]),
      ('d0_is_local_sgd', 0, [3, 7, 11], [0, 0, 0], [3, 7, 11]),
      ('d_equals_tau', 4, [7, 11], [4, 4], [3, 7, 11]),
  )
  def test_schedule(self, delay, applies, ages, snapshots):
    block = helpers.clock(dasgd.DelayedAverage(4, delay), workers=4, base_s=X).next_block(12)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.snapshot), snapshots)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), applies)
    np.testing.assert_array_equal(block.schedule.average_age[applies], ages)
    self.assertEqual(schedules.uniform_fields(type(block.schedule)), ('snapshot', 'apply_average', 'average_age'))

  def _allreduce_clock(self, rule, allreduce_steps):
    """A clock whose all-reduce of the model takes `allreduce_steps` x X (bandwidth only)."""
    network = {'kind': 'alpha_beta', 'latency_s': 0.0, 'bandwidth_gbps': 1.0}
    seconds_per_byte = 8e-9
    model_bytes = allreduce_steps * X / (2 * (P - 1) / P * seconds_per_byte)
    clock = helpers.clock(rule, workers=P, base_s=X, network=network, model_bytes=model_bytes)
    self.assertAlmostEqual(clock.network.allreduce(model_bytes, P), allreduce_steps * X)
    return clock

  def test_hides_an_allreduce_shorter_than_d_steps(self):
    clock = self._allreduce_clock(dasgd.DelayedAverage(4, 2), allreduce_steps=1.5)
    block = clock.next_block(40)
    np.testing.assert_allclose(block.duration, X, rtol=1e-9)  # no communication on the critical path
    np.testing.assert_allclose(block.idle, 0.0, atol=1e-15)
    periodic = self._allreduce_clock(local_sgd.PeriodicAverage(every(4)), allreduce_steps=1.5).next_block(40)
    np.testing.assert_allclose(periodic.sim_time[-1], 40 * X + 10 * 1.5 * X, rtol=1e-9)

  def test_waits_for_the_part_of_the_allreduce_it_cannot_hide(self):
    clock = self._allreduce_clock(dasgd.DelayedAverage(4, 1), allreduce_steps=1.5)
    block = clock.next_block(41)
    # Each apply step waits 0.5 X: the mean is ready 1.5 X after the snapshot, one step (X) is overlapped.
    np.testing.assert_allclose(block.sim_time[-1], 41 * X + 10 * 0.5 * X, rtol=1e-9)

  def test_lap_sgd_delay_from_network_and_hidden_averaging(self):
    clock = self._allreduce_clock(lap_sgd.NodeThreads(4, every(16)), allreduce_steps=2.5)
    block = clock.next_block(64)
    self.assertEqual(clock.rule_state['delay_steps'], 3)  # ceil(2.5 X / X)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.snapshot), [15, 31, 47, 63])
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), [18, 34, 50])
    np.testing.assert_array_equal(block.schedule.thread[:8], [0, 1, 2, 3, 0, 1, 2, 3])
    np.testing.assert_allclose(block.duration, X, rtol=1e-9)

  def test_lap_sgd_snapshot_before_previous_apply_forces_it(self):
    clock = helpers.clock(lap_sgd.NodeThreads(1, every(2), delay_steps=3), workers=4, base_s=X)
    block = clock.next_block(8)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), [3, 5, 7])
    np.testing.assert_array_equal(block.schedule.average_age[[3, 5, 7]], [2, 2, 2])

  def test_lap_sgd_q1_d0_is_local_sgd(self):
    kwargs = dict(workers=P, kind='lognormal', base_s=X, sigma=0.5)
    lap = helpers.clock(lap_sgd.NodeThreads(1, every(4), delay_steps=0), **kwargs).next_block(40)
    local = helpers.clock(local_sgd.PeriodicAverage(every(4)), **kwargs).next_block(40)
    np.testing.assert_allclose(lap.sim_time, local.sim_time, rtol=1e-12)


class WagmaTest(parameterized.TestCase):

  def test_groups_from_the_spec(self):
    np.testing.assert_array_equal(wagma.group_ids(0, 8, 4), [0, 0, 0, 0, 4, 4, 4, 4])
    np.testing.assert_array_equal(wagma.group_ids(1, 8, 4), [0, 0, 2, 2, 0, 0, 2, 2])
    self.assertEqual(wagma.group_masks(1, 8, 4), [4, 1])

  @parameterized.named_parameters(*[(f'{name}_{rule}', network, rule) for rule in wagma.RULES
                                    for name, network in (('ideal', {}), ('alpha_beta', NET))])
  def test_no_stragglers_never_stale(self, network, rule_name):
    rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=5, rule=rule_name)
    clock = helpers.clock(rule, workers=16, base_s=X, network=network)
    block = clock.next_block(50)
    self.assertTrue(block.schedule.fresh.all())
    self.assertFalse(block.schedule.behind.any())
    np.testing.assert_array_equal(block.measurements['stale'], 0)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.global_average), [4, 9, 14, 19, 24,
                                                                                          29, 34, 39, 44, 49])
    group = clock.network.allreduce(clock.model_bytes, 4)  # everyone arrives together: A_i = x_i, no hop
    every = clock.network.allreduce(clock.model_bytes, 16)
    if rule_name == 'authors':  # W(t) is exchanged while the gradient is computed
      expected = np.where(block.schedule.global_average, max(X, every), max(X, group))
    else:
      expected = np.where(block.schedule.global_average, X + every, X + group)
    np.testing.assert_allclose(block.duration, expected, rtol=1e-9)

  @parameterized.named_parameters(*[(rule, rule) for rule in wagma.RULES])
  def test_delayed_workers_are_stale_and_nobody_waits_for_them(self, rule_name):
    rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=8, rule=rule_name)
    clock = helpers.clock(rule, workers=16, base_s=X, delayed_workers=2, delay_s=0.032)
    block = clock.next_block(64)
    stale = ~block.schedule.fresh
    regular = ~block.schedule.global_average
    if rule_name == 'step_then_average':
      # At least the two workers delayed at this step (a delay of 3.2 steps keeps a worker late for a while).
      self.assertTrue(np.all(stale[regular].sum(axis=1) >= 2))
    else:
      # W(t) is posted at the start: a worker delayed in iteration t is late from t + 1 on (and the global
      # average is no barrier on the finish times: a delayed worker may still finish before the others' data).
      self.assertTrue(np.all(stale[regular][1:].sum(axis=1) >= 1))
      self.assertFalse(stale[0].any())
      self.assertGreater(stale[regular].sum(axis=1).mean(), 2)
    self.assertGreater(block.measurements['behind'].sum(), 0)         # 3.2 steps late: more than one behind
    self.assertFalse(stale[~regular].any())
    # Wait-avoiding: over 8 iterations, max_i sum X_i instead of sum max_i X_i of all-reduce SGD.
    barrier = helpers.clock(sync.Barrier(), workers=16, base_s=X, delayed_workers=2, delay_s=0.032)
    self.assertLess(block.sim_time[-1], 0.6 * barrier.next_block(64).sim_time[-1])

  def test_tau_one_is_global_average(self):
    block = helpers.clock(wagma_rule.WaitAvoidingGroups(2, 1), workers=4, kind='exponential', rate=100.0).next_block(9)
    self.assertTrue(block.schedule.global_average.all())
    self.assertTrue(block.schedule.fresh.all())


class FailureTest(parameterized.TestCase):

  def test_barrier_waits_for_a_worker_that_returns(self):
    # Worker 3 fails during iteration 5 (0.05 .. 0.06) and is back at 0.2: the lost micro-batch restarts.
    clock = helpers.clock(sync.Barrier(), workers=4, base_s=X, fail_worker=3, fail_at_s=0.055, return_at_s=0.2)
    block = clock.next_block(8)
    np.testing.assert_allclose(block.sim_time, [0.01, 0.02, 0.03, 0.04, 0.05, 0.21, 0.22, 0.23])

  def test_rules_that_need_every_worker_stop_at_the_failure_with_one_line(self):
    for rule in (sync.Barrier(), ksync.KSync(4)):
      clock = helpers.clock(rule, workers=4, base_s=X, fail_worker=3, fail_at_s=0.05)
      clock.next_block(4)  # before the failure: runs
      with self.assertRaises(clock_lib.StalledError) as raised:
        clock.next_block(4)
      message = str(raised.exception)
      self.assertNotIn('\n', message)
      self.assertRegex(message, r'^worker\(s\) \[3\] failed for good at 0.05 s of simulated time, and '
                       f'{type(rule).__name__} waits for every worker at iteration [45]')
    self.assertEqual(helpers.clock(ksync.KSync(3), workers=4, fail_worker=3, fail_at_s=0.05).lost_workers, 1)
    self.assertIsNone(helpers.clock(sync.Barrier(), workers=4, fail_worker=-1).failure)

  def test_a_clock_built_by_hand_raises_a_clear_stall(self):
    ok = helpers.clock(ksync.KSync(3), workers=4, base_s=X, fail_worker=3, fail_at_s=0.05)
    clock = clock_lib.Clock(workers=4, rule=sync.Barrier(), compute=ok.compute, network=ok.network,
                            model_bytes=1.0, seed=0, failure=ok.failure)
    clock.next_block(4)
    with self.assertRaisesRegex(clock_lib.StalledError, r'worker\(s\) \[3\] failed for good .* Barrier waits'):
      clock.next_block(4)

  @parameterized.named_parameters(
      ('ksync', lambda: ksync.KSync(3), 'contributions'),
      ('kasync', lambda: kasync.KAsync(2), 'contributions'),
      ('kbatch_sync', lambda: kbatch_sync.KBatchSync(4), 'contributions'),
      ('kbatch_async', lambda: kbatch_async.KBatchAsync(2), 'contributions'),
      ('nonblocking', lambda: nonblocking.NonBlocking(2), 'microbatches_done'),
      ('adasync', lambda: adasync.AdaSync(ksync.KSync(3), k0=3, period_s=0.01), 'contributions'),
  )
  def test_k_of_p_rules_proceed_without_the_failed_worker(self, make_rule, field):
    clock = helpers.clock(make_rule(), workers=4, kind='exponential', rate=100.0, fail_worker=3, fail_at_s=0.2)
    if isinstance(clock.rule, adasync.AdaSync):
      clock.feedback(train_loss=1.0)
      clock.feedback(train_loss=1e-3)  # asks for K = P; capped at the 3 workers that are left
    block = clock.next_block(300)
    after = block.sim_time > 0.3
    self.assertGreater(after.sum(), 50)
    self.assertTrue(np.all(np.isfinite(block.sim_time)))
    self.assertEqual(int(np.asarray(getattr(block.schedule, field))[after, 3].sum()), 0)
    self.assertGreater(int(np.asarray(getattr(block.schedule, field))[~after, 3].sum()), 0)

  def test_kasync_worker_returns(self):
    clock = helpers.clock(kasync.KAsync(1), workers=4, base_s=X, fail_worker=(2, 3), fail_at_s=0.1,
                          return_at_s=0.3)
    block = clock.next_block(200)
    during = (block.sim_time > 0.11) & (block.sim_time < 0.3)
    self.assertFalse(block.schedule.contributions.astype(bool)[during][:, 2:].any())
    self.assertTrue(block.schedule.contributions.astype(bool)[block.sim_time > 0.31][:, 2:].any())


class ResumeTest(parameterized.TestCase):
  """Draw 2 blocks, save, draw 3; a fresh clock restored from the save draws the same 3."""

  @parameterized.named_parameters(*[(name, make_rule) for name, make_rule, _ in ALL_RULES])
  def test_resume_is_exact(self, make_rule):
    kwargs = dict(workers=P, network=NET, kind='exponential', rate=100.0, slow_workers=(1,), slow_factor=1.5,
                  delayed_workers=1, delay_s=0.02)

    def feedback(clock, block):
      clock.feedback(train_loss=1.0 / (1.0 + float(block.sim_time[-1])))

    clock = helpers.clock(make_rule(), **kwargs)
    for _ in range(2):
      feedback(clock, clock.next_block(7))
    saved = helpers.json_round_trip(clock.state_dict())
    expected = []
    for _ in range(3):
      expected.append(clock.next_block(7))
      feedback(clock, expected[-1])
    restored = helpers.clock(make_rule(), **kwargs)
    restored.load_state_dict(saved)
    for want in expected:
      got = restored.next_block(7)
      helpers.assert_blocks_equal(self, got, want)
      feedback(restored, got)

  def test_resume_with_trace_and_failure(self):
    path = self.create_tempfile('trace.npy').full_path
    np.save(path, np.random.default_rng(0).uniform(0.005, 0.02, size=(13, 4)))
    kwargs = dict(workers=4, kind='trace', trace_path=path, fail_worker=1, fail_at_s=0.05, return_at_s=0.08)
    clock = helpers.clock(nonblocking.NonBlocking(3), **kwargs)
    clock.next_block(5)
    saved = helpers.json_round_trip(clock.state_dict())
    want = clock.next_block(9)
    restored = helpers.clock(nonblocking.NonBlocking(3), **kwargs)
    restored.load_state_dict(saved)
    helpers.assert_blocks_equal(self, restored.next_block(9), want)

  def test_state_is_strict_json_except_infinity(self):
    clock = helpers.clock(kasync.KAsync(2), workers=4, fail_worker=0, fail_at_s=0.0)
    clock.next_block(3)
    text = json.dumps(clock.state_dict())
    self.assertIn('Infinity', text)  # the lost worker's in-flight job
    self.assertTrue(math.isinf(json.loads(text)['rule_state']['finish']['__ndarray__'][0]))


class _OnlyIterate(kasync.KAsync):
  """K-async with its vectorised `iterate_block` switched off, so that the clock takes the per-iteration path."""
  vectorized = False


class FastPathTest(absltest.TestCase):

  def test_kasync_block_path_equals_iterations(self):
    kwargs = dict(workers=12, kind='pareto', shape=2.5, scale=0.01, delayed_workers=2, delay_s=0.05,
                  network=NET)
    fast = helpers.clock(kasync.KAsync(5, 2), **kwargs)
    slow = helpers.clock(_OnlyIterate(5, 2), **kwargs)
    for _ in range(3):
      helpers.assert_blocks_equal(self, fast.next_block(50), slow.next_block(50), idle_fraction_rtol=1e-12)
    self.assertEqual(helpers.json_round_trip(fast.state_dict()), helpers.json_round_trip(slow.state_dict()))


if __name__ == '__main__':
  absltest.main()
