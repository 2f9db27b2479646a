"""The per-call overhead (`stragglers.overhead_s`): what a micro-batch costs in every time rule.

A call on the configured micro-batch costs o + X (X the distribution, its per-sample part); a job of m
micro-batches m o + its m draws; LAP-SGD's Q threads share one call per wave of Q micro-batches. Closed forms
with constant compute on an ideal network, the same random draws as without the overhead, the vectorised
paths against the per-iteration ones, and bit-identical replays when o = 0.
"""

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
from waitless.cluster.rules import streaming_diloco
from waitless.cluster.rules import sync
from waitless.cluster.rules import wagma
from waitless.cluster import clock as clock_lib
from waitless.cluster import compute
from waitless.cluster import factory
from waitless.cluster import network
from tests.cluster import helpers

X = 0.01   # constant per-sample part of one micro-batch (s)
O = 0.004  # noqa: E741  overhead per call (s)
M = 2      # micro-batches per mini-batch
P = 8


def every(h):
  return lambda t: (t + 1) % h == 0


# name, rule factory, mean iteration time with constant compute X, overhead O and an ideal network.
CLOSED_FORMS = (
    ('barrier', lambda: sync.Barrier(M), M * (O + X)),
    ('periodic_average', lambda: local_sgd.PeriodicAverage(every(4), M), M * (O + X)),
    ('ring_gossip', lambda: dpsgd.RingGossip(M), M * (O + X)),
    ('ring_gossip_overlap', lambda: dpsgd.RingGossip(M, order='overlap'), M * (O + X)),
    ('nonblocking_fastest', lambda: nonblocking.NonBlocking(M), M * (O + X)),
    ('nonblocking_deadline', lambda: nonblocking.NonBlocking(M, trigger='deadline', deadline_s=1.0), M * (O + X)),
    ('ksync', lambda: ksync.KSync(3, M), M * (O + X)),
    ('kbatch_sync', lambda: kbatch_sync.KBatchSync(3, M), M * (O + X)),
    ('kasync_k4', lambda: kasync.KAsync(4, M), M * (O + X) * 4 / P),
    ('kbatch_async_k4', lambda: kbatch_async.KBatchAsync(4, M), M * (O + X) * 4 / P),
    ('adasync', lambda: adasync.AdaSync(ksync.KSync(1, M), k0=2, period_s=0.05), M * (O + X)),
    ('dasgd', lambda: dasgd.DelayedAverage(4, 1, M), M * (O + X)),
    ('streaming_diloco', lambda: streaming_diloco.StreamingAverage(4, 2, 1, microbatches=M), M * (O + X)),
    ('wagma', lambda: wagma.WaitAvoidingGroups(4, 4, M), M * (O + X)),
    # Q threads: Q node updates share M calls of Q micro-batches: M (O / Q + X) per update.
    ('lap_sgd_q1', lambda: lap_sgd.NodeThreads(1, every(16), M), M * (O + X)),
    ('lap_sgd_q2', lambda: lap_sgd.NodeThreads(2, every(16), M), M * (O / 2 + X)),
    ('lap_sgd_q4', lambda: lap_sgd.NodeThreads(4, every(16), M), M * (O / 4 + X)),
    ('lpp_sgd_q4_partial', lambda: lap_sgd.NodeThreads(4, every(16), M, prepass_steps=0, partial_cost=0.5),
     M * (O / 4 + X) * 0.75),  # from update 0: Q full updates, then Q partial ones at half the cost
)

# The rules whose workers run their m micro-batches in sequence, one call each; LAP-SGD's Q threads share
# each call: name, rule with m micro-batches, calls sharing one overhead (Q).
SPLITTING = (
    ('barrier', lambda m: sync.Barrier(m), 1),
    ('periodic_average', lambda m: local_sgd.PeriodicAverage(every(3), m), 1),
    ('ring_gossip', lambda m: dpsgd.RingGossip(m), 1),
    ('nonblocking', lambda m: nonblocking.NonBlocking(m), 1),
    ('nonblocking_ring', lambda m: nonblocking.NonBlocking(m, topology='ring'), 1),
    ('ksync', lambda m: ksync.KSync(4, m), 1),
    ('kbatch_sync', lambda m: kbatch_sync.KBatchSync(4, m), 1),
    ('dasgd', lambda m: dasgd.DelayedAverage(2, 1, m), 1),
    ('wagma', lambda m: wagma.WaitAvoidingGroups(4, 4, m), 1),
    ('lap_sgd_q2', lambda m: lap_sgd.NodeThreads(2, every(8), m), 2),
)


class ClosedFormTest(parameterized.TestCase):

  @parameterized.named_parameters(*CLOSED_FORMS)
  def test_iteration_time_with_overhead(self, make_rule, expected):
    clock = helpers.clock(make_rule(), workers=P, base_s=X, overhead_s=O)
    block = clock.next_block(64)
    np.testing.assert_allclose(block.sim_time[-1] / 64, expected, rtol=1e-9)
    np.testing.assert_allclose(block.idle, 0.0, atol=1e-12)

  @parameterized.named_parameters(*SPLITTING)
  def test_m_microbatches_cost_m_minus_one_overheads_more_than_one_batch(self, make_rule, q):
    # The same per-sample compute (X per batch) in 1 or 4 calls: (4 - 1) O more per batch (per Q batches
    # for LAP-SGD's threads).
    one = helpers.clock(make_rule(1), workers=P, base_s=X, overhead_s=O).next_block(40)
    four = helpers.clock(make_rule(4), workers=P, base_s=X / 4, overhead_s=O).next_block(40)
    np.testing.assert_allclose(one.duration, O / q + X, rtol=1e-9)
    np.testing.assert_allclose(four.duration - one.duration, 3 * O / q, rtol=1e-9)
    # Without an overhead splitting is free: the simulator charged a small batch as if it used the
    # accelerator as well as a large one.
    free = helpers.clock(make_rule(4), workers=P, base_s=X / 4).next_block(40)
    np.testing.assert_allclose(free.duration, X, rtol=1e-9)

  def test_slow_workers_pay_a_slower_overhead_and_nonblocking_follows_the_fast_ones(self):
    slow = {'slow_workers': (0, 1), 'slow_factor': 4.0}
    for m in (1, 4):
      with self.subTest(m=m):
        barrier = helpers.clock(sync.Barrier(m), workers=P, base_s=X / m, overhead_s=O, **slow).next_block(10)
        np.testing.assert_allclose(barrier.duration, 4.0 * (m * O + X), rtol=1e-9)  # the slow worker's job
        rule = nonblocking.NonBlocking(m, activation_latency_s=0.0)
        cut = helpers.clock(rule, workers=P, base_s=X / m, overhead_s=O, **slow).next_block(10)
        np.testing.assert_allclose(cut.duration, m * O + X, rtol=1e-9)  # the fast workers' job
        # A slow micro-batch takes 4 (O + X / m): finished ones by the cut at m (O + X / m).
        np.testing.assert_array_equal(cut.schedule.microbatches_done[:, :2], m // 4)
        np.testing.assert_array_equal(cut.schedule.microbatches_done[:, 2:], m)

  def test_lap_threads_save_overheads_only(self):
    # Q = 4 threads against Q = 1: the same per-sample work per update, a quarter of the overhead.
    times = {}
    for q in (1, 4):
      clock = helpers.clock(lap_sgd.NodeThreads(q, every(8), M, delay_steps=1), workers=P, base_s=X, overhead_s=O)
      times[q] = clock.next_block(64).sim_time[-1]
    np.testing.assert_allclose(times[1] - times[4], 64 * M * O * (1 - 1 / 4), rtol=1e-9)

  def test_lap_delay_from_the_nominal_update_with_overhead(self):
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 0.02}
    for q, overhead in ((1, 0.0), (4, 0.0), (1, O), (4, O)):
      with self.subTest(q=q, overhead=overhead):
        clock = helpers.clock(lap_sgd.NodeThreads(q, every(16), M), workers=P, base_s=X, overhead_s=overhead,
                              network=net, model_bytes=38_440)
        clock.next_block(1)
        allreduce = clock.network.allreduce(38_440, P)
        self.assertEqual(clock.rule_state['delay_steps'], int(np.ceil(allreduce / (M * (X + overhead / q)))))


class SameDrawsTest(parameterized.TestCase):

  def test_the_overhead_adds_to_the_same_random_draws(self):
    kwargs = dict(workers=P, seed=4, kind='exponential', rate=100.0)
    plain = helpers.clock(sync.Barrier(M), **kwargs).next_block(200)
    loaded = helpers.clock(sync.Barrier(M), overhead_s=O, **kwargs).next_block(200)
    np.testing.assert_allclose(loaded.duration, plain.duration + M * O, rtol=1e-12)
    # LAP-SGD never averaging (an average makes a node wait for the others' snapshots, not for its own
    # overheads): every node's time moves by M O / Q per update.
    never = lambda t: False
    plain = helpers.clock(lap_sgd.NodeThreads(4, never, M), **kwargs).next_block(200)
    loaded = helpers.clock(lap_sgd.NodeThreads(4, never, M), overhead_s=O, **kwargs).next_block(200)
    np.testing.assert_allclose(loaded.sim_time, plain.sim_time + np.arange(1, 201) * M * O / 4, rtol=1e-12)

  @parameterized.named_parameters(
      ('ksync', lambda: ksync.KSync(3, M)),
      ('kbatch_sync', lambda: kbatch_sync.KBatchSync(5, M)),
      ('kasync', lambda: kasync.KAsync(3, M)),
      ('kbatch_async', lambda: kbatch_async.KBatchAsync(3, M)),
      ('async_ringmaster', lambda: kbatch_async.KBatchAsync(1, M, max_delay=4)),
      ('lap_sgd', lambda: lap_sgd.NodeThreads(4, every(8), M)),
      ('nonblocking', lambda: nonblocking.NonBlocking(3)),
  )
  def test_vectorised_paths_equal_the_event_loop(self, make_rule):
    # The parameter-server rules draw ahead from the model itself (`parameter_server.Draws`): the overhead
    # and the slow factor on it must come out as the clock's `work` gives them.
    for delay in (0.0, 0.02):
      kwargs = dict(workers=P, seed=9, kind='shifted_exponential', shift_s=0.002, rate=200.0, overhead_s=O,
                    slow_workers=(1, 6), slow_factor=2.5, delayed_workers=1 if delay else 0, delay_s=delay)
      loop, fast = helpers.clock(make_rule(), **kwargs), helpers.clock(make_rule(), **kwargs)
      for n in (70, 1, 29):
        helpers.assert_blocks_equal(self, loop._block(n), fast.next_block(n))
      self.assertEqual(loop.state_dict(), fast.state_dict())


class ZeroOverheadTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('barrier', lambda: sync.Barrier(3)),
      ('nonblocking', lambda: nonblocking.NonBlocking(4)),
      ('lap_sgd', lambda: lap_sgd.NodeThreads(4, every(8), 2)),
      ('kasync', lambda: kasync.KAsync(3, 2)),
  )
  def test_replays_bit_for_bit_the_clock_of_the_bare_distribution(self, make_rule):
    kwargs = dict(kind='pareto', shape=2.5, scale=0.004, slow_workers=(2,), delayed_workers=1, delay_s=0.01)
    config = helpers.config(P, 3, overhead_s=0.0, **kwargs)
    self.assertNotIsInstance(factory.make_compute(config.stragglers, P).base, compute.CallOverhead)
    bare = compute.SlowWorkers(base=compute.Pareto(shape=2.5, scale=0.004),
                               factors=factory.slow_factors(config.stragglers, P))
    delay, failure = factory.make_faults(config.stragglers, P, 3)
    direct = clock_lib.Clock(workers=P, rule=make_rule(), compute=bare, network=network.Ideal(), model_bytes=1e6,
                             seed=3, delay=delay, failure=failure)
    a = direct.next_block(150)
    b = factory.make_clock(config, make_rule(), 1e6).next_block(150)
    helpers.assert_blocks_equal(self, a, b)


class CallOverheadModelTest(absltest.TestCase):

  def test_composition_with_slow_workers(self):
    model = factory.make_compute(helpers.config(4, overhead_s=O, kind='exponential', slow_workers=(3,),
                                                slow_factor=2.0).stragglers, 4)
    self.assertIsInstance(model, compute.SlowWorkers)
    self.assertIsInstance(model.base, compute.CallOverhead)
    self.assertAlmostEqual(model.mean(), (O + 0.01) * 5 / 4)
    per_sample, overhead = compute.split_overhead(model, 4)
    np.testing.assert_allclose(overhead, [O, O, O, 2 * O])
    workers, units = np.array([0, 3, 3]), np.zeros(3, np.int64)
    whole = model.sample(np.random.default_rng(1), workers, units)
    part = per_sample.sample(np.random.default_rng(1), workers, units)
    np.testing.assert_allclose(whole, part + overhead[workers], rtol=1e-12)
    self.assertFalse(compute.reads_units(model))
    self.assertEqual(compute.split_overhead(compute.Constant(X), 2)[1].tolist(), [0.0, 0.0])

  def test_trace_is_the_per_sample_part(self):
    path = self.create_tempfile('t.npy').full_path
    np.save(path, np.array([[0.01, 0.02], [0.03, 0.01]]))
    clock = helpers.clock(sync.Barrier(), workers=2, kind='trace', trace_path=path, overhead_s=O)
    self.assertTrue(compute.reads_units(clock.compute))
    np.testing.assert_allclose(clock.next_block(4).duration, np.array([0.02, 0.03, 0.02, 0.03]) + O)


if __name__ == '__main__':
  absltest.main()
