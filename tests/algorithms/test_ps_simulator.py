"""The parameter-server rules' vectorised simulator (`iterate_block`) against their event loops (`iterate`).

`Clock._block` runs a rule one `iterate` at a time (the event loop, kept as the float reference); the clock's
fast path runs `iterate_block`. Both must give identical schedules, times, idle times, staleness, bytes and
measurements, leave the generator, the unit and job counters and the rule's state identical, over thousands of
updates, several seeds, K, micro-batches, straggler models (ties included), transient delays (in the vectorised
path too, but K-batch-sync's) and failures.
Also: Ringmaster's event rule on a hand-computed example, and R = infinity is async.
"""

import functools
import os
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import adasync
from waitless.cluster.rules import kasync
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from waitless.cluster.rules import ksync
from tests.cluster import helpers

P = 16
STRAGGLERS = {
    'exponential': {'kind': 'exponential', 'rate': 100.0},
    'pareto': {'kind': 'pareto', 'shape': 1.5, 'scale': 0.01},
    'lognormal_micro': {'kind': 'lognormal', 'base_s': 0.01, 'sigma': 0.5},
    'constant_ties': {'kind': 'constant', 'base_s': 0.01},
    # Times equal to 1e-14: distinct on their own, tied once added to the clock (KBatchSync's corrector).
    'rounding_ties': {'kind': 'lognormal', 'base_s': 0.01, 'sigma': 1e-14},
    'slow_workers': {'kind': 'shifted_exponential', 'shift_s': 0.005, 'rate': 200.0, 'slow_fraction': 0.25,
                     'slow_factor': 3.0},
    'random_delay': {'kind': 'exponential', 'rate': 100.0, 'delayed_workers': 2, 'delay_s': 0.03},
    # The quickstart's preset: slow workers and one delayed worker per job index, on micro-batches.
    'slow_workers_delay_micro': {'kind': 'shifted_exponential', 'shift_s': 0.005, 'rate': 200.0,
                                 'slow_fraction': 0.25, 'slow_factor': 2.0, 'delayed_workers': 1,
                                 'delay_s': 0.03},
    'failure_returns': {'kind': 'exponential', 'rate': 100.0, 'fail_worker': (1, 5), 'fail_at_s': 0.2,
                        'return_at_s': 0.5},
    'failure_permanent': {'kind': 'exponential', 'rate': 100.0, 'fail_worker': (2,), 'fail_at_s': 0.3,
                          'return_at_s': -1},
}
RULES = {
    'ksync': lambda k, m: ksync.KSync(k, m),
    'kbatch_sync': lambda k, m: kbatch_sync.KBatchSync(k, m),
    'kasync': lambda k, m: kasync.KAsync(k, m),
    'kbatch_async': lambda k, m: kbatch_async.KBatchAsync(k, m),
    'ringmaster_k1': lambda k, m: kbatch_async.KBatchAsync(1, m, max_delay=k),
    'ringmaster_batch': lambda k, m: kbatch_async.KBatchAsync(k, m, max_delay=2),
}
BLOCKS = (700, 1, 37, 262)  # 1000 updates in uneven blocks


def _cases():
  seeds = iter(range(100))
  for rule in RULES:
    for name in STRAGGLERS:
      k, m = (3, 2) if name.endswith('_micro') else (5, 1)
      yield f'{rule}_{name}', rule, name, k, m, next(seeds)


class VectorisedMatchesEventLoopTest(parameterized.TestCase):

  def _clock(self, rule, stragglers, seed, network, path=None):
    extra = {'trace_path': path} if path else {}
    return helpers.clock(rule, workers=P, model_bytes=4e6, seed=seed, network=network,
                         **{**stragglers, **extra})

  def _compare(self, make_rule, stragglers, seed, blocks=BLOCKS, network=None, path=None):
    network = network or {'kind': 'alpha_beta'}
    loop = self._clock(make_rule(), stragglers, seed, network, path)
    fast = self._clock(make_rule(), stragglers, seed, network, path)
    self.assertTrue(fast.rule.vectorized)
    # Without a trace or failures (K-sync: without failures; K-batch-sync: nor delays) the event loop must not
    # run at all.
    falls_back = 'fail_worker' in stragglers or (not isinstance(fast.rule, ksync.KSync) and path is not None) or (
        isinstance(fast.rule, kbatch_sync.KBatchSync) and 'delayed_workers' in stragglers)
    for n in blocks:
      a = loop._block(n)
      if falls_back:
        b = fast.next_block(n)
      else:
        with mock.patch.object(type(fast.rule), 'iterate', side_effect=AssertionError('event loop ran')):
          b = fast.next_block(n)
      helpers.assert_blocks_equal(self, a, b, idle_fraction_rtol=1e-9)
    np.testing.assert_array_equal(loop.times, fast.times)
    np.testing.assert_array_equal(loop.units, fast.units)
    np.testing.assert_array_equal(loop.jobs, fast.jobs)
    self.assertEqual(loop.sim_time, fast.sim_time)
    self.assertEqual(loop._rng.bit_generator.state, fast._rng.bit_generator.state)
    self.assertEqual(sorted(loop.rule_state), sorted(fast.rule_state))
    for key, value in loop.rule_state.items():
      np.testing.assert_array_equal(value, fast.rule_state[key], err_msg=key)
    return a

  @parameterized.named_parameters(*_cases())
  def test_identical(self, rule, stragglers, k, m, seed):
    self._compare(lambda: RULES[rule](k, m), STRAGGLERS[stragglers], seed)

  @parameterized.named_parameters(*((name, name) for name in RULES))
  def test_identical_with_a_trace_and_an_ideal_network(self, rule):
    times = np.random.default_rng(3).exponential(0.01, size=(50, P)) * np.sqrt(np.arange(1, P + 1))
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'trace.npy')
      np.save(path, times)
      self._compare(lambda: RULES[rule](4, 1), {'kind': 'trace'}, 7, blocks=(300, 200), network={'kind': 'ideal'},
                    path=path)

  @parameterized.named_parameters(('k1', 1), ('k_all', P))
  def test_identical_at_the_extremes_of_k(self, k):
    for rule in ('ksync', 'kbatch_sync', 'kasync', 'kbatch_async'):
      with self.subTest(rule):
        make = functools.partial(RULES[rule], k, 1)
        self._compare(make, STRAGGLERS['exponential'], 11, blocks=(500,))

  def test_ringmaster_discards_and_rewinds_the_generator(self):
    # Many discards (R = 2 with a slow quarter): the generator must end where the event loop's ends.
    last = self._compare(lambda: kbatch_async.KBatchAsync(1, 1, max_delay=2), STRAGGLERS['slow_workers'], 5)
    self.assertGreater(last.measurements['discarded'].sum(), 10)


class AdaSyncBlocksTest(parameterized.TestCase):

  @parameterized.named_parameters(('ksync', 'ksync'), ('kbatch_sync', 'kbatch_sync'), ('kasync', 'kasync'),
                                  ('kbatch_async', 'kbatch_async'))
  def test_identical_with_k_changing_inside_blocks(self, base):
    def make():
      rule = adasync.AdaSync(adasync.BASE_RULES[base](k=2), k0=2, period_s=0.05)
      return helpers.clock(rule, workers=P, seed=9, kind='exponential', rate=100.0, network={'kind': 'alpha_beta'})
    loop, fast = make(), make()
    ks = []
    for b, n in enumerate((40, 1, 75, 60, 33, 90, 50, 64, 128)):
      a, c = loop._block(n), fast.next_block(n)
      helpers.assert_blocks_equal(self, a, c, idle_fraction_rtol=1e-9)
      ks.extend(c.schedule.k.tolist())
      loss = 2.0 / (1.0 + b) if b < 6 else 1.0  # K grows, then stays
      loop.feedback(train_loss=loss)
      fast.feedback(train_loss=loss)
    self.assertEqual(loop.rule_state['next_adjust_s'], fast.rule_state['next_adjust_s'])
    self.assertEqual(loop._rng.bit_generator.state, fast._rng.bit_generator.state)
    changed_inside = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    self.assertGreaterEqual(len(changed_inside), 3)
    self.assertGreater(max(ks), 2)


class RingmasterRuleTest(parameterized.TestCase):

  def test_hand_computed_events(self):
    # Two learners, constant times (a trace): learner 0 takes 1 s, learner 1 takes 3 s; ideal network, async
    # with R = 2. Learner 0 pushes at t = 1, 2, 3, ... (update t - 1). Learner 1 arrives at t = 3 after learner
    # 0's push of update 2 (ties: worker 0 first), in update 3, with delay 3 - 0 = 3 >= 2: discarded; it
    # restarts on W_3 and arrives at t = 6, again after learner 0 (update 6), with delay 6 - 3 = 3: discarded.
    times = np.tile(np.array([[1.0, 3.0]]), (4, 1))
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'trace.npy')
      np.save(path, times)
      clock = helpers.clock(kbatch_async.KBatchAsync(1, max_delay=2), workers=2, kind='trace', trace_path=path,
                            network={'kind': 'ideal'})
      block = clock.next_block(7)
    np.testing.assert_array_equal(block.sim_time, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(block.schedule.contributions, [[1, 0]] * 7)
    np.testing.assert_array_equal(block.schedule.discarded[:, 1], [0, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(block.schedule.fetch_current[:, 1], [0, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(block.schedule.microbatches_done[:, 1], 0)  # discarded work: no samples
    np.testing.assert_array_equal(block.measurements['discarded'], [0, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(block.schedule.staleness[:, 0], 0)

  def test_without_a_threshold_it_is_async(self):
    for k in (1, 3):
      plain = helpers.clock(kbatch_async.KBatchAsync(k), workers=P, seed=4, kind='exponential', rate=100.0)
      huge = helpers.clock(kbatch_async.KBatchAsync(k, max_delay=10**9), workers=P, seed=4, kind='exponential',
                           rate=100.0)
      a, b = plain.next_block(500), huge.next_block(500)
      for key, x in a.schedule._asdict().items():
        np.testing.assert_array_equal(x, getattr(b.schedule, key), err_msg=key)
      np.testing.assert_array_equal(a.sim_time, b.sim_time)
      np.testing.assert_array_equal(b.measurements['discarded'], 0)

  def test_rejects_a_threshold_below_one(self):
    with self.assertRaisesRegex(ValueError, 'max_delay=0'):
      kbatch_async.KBatchAsync(1, max_delay=0)


class RennalaTest(absltest.TestCase):
  """Rennala SGD (Tyurin & Richtarik 2023) with batch B: B gradients computed at the current point x^k from any
  workers, a gradient computed at an older point discarded on arrival and its worker sent to x^k.

  Event by event that is `kbatch_async` with K = B and max_delay = 1. `kbatch_sync` with K = B applies the same
  update (B gradients, all at W_t, staleness 0) but cancels the work in flight at every update, so every learner
  restarts at once on the new point: Rennala with calculation stops, never slower.
  """

  def _clocks(self, seconds, k):
    """(kbatch_sync, Rennala) clocks; learner i takes seconds[i] per gradient, ideal network."""
    times = np.tile(np.asarray(seconds, np.float64)[None, :], (4, 1))
    path = os.path.join(self.create_tempdir().full_path, 'trace.npy')
    np.save(path, times)
    make = lambda rule: helpers.clock(rule, workers=len(seconds), kind='trace', trace_path=path,
                                      network={'kind': 'ideal'})
    return make(kbatch_sync.KBatchSync(k)), make(kbatch_async.KBatchAsync(k, max_delay=1))

  def test_same_update_different_time_rule(self):
    # Learners take 1.0 and 1.2 s, B = 2. Update 0: learner 0 at 1.0, learner 1 at 1.2, both at W_0, in both.
    # K-batch-sync cancels learner 0's second gradient (1.0 -> 2.0) and restarts both at 1.2: update 1 at 2.4.
    # Rennala lets it finish at 2.0 on W_0: delay 1, discarded; it restarts on W_1 and pushes at 3.0, after
    # learner 1's (2.4): update 1 at 3.0.
    sync_clock, rennala = self._clocks([1.0, 1.2], 2)
    a, b = sync_clock.next_block(2), rennala.next_block(2)
    np.testing.assert_allclose(a.sim_time, [1.2, 2.4])
    np.testing.assert_allclose(b.sim_time, [1.2, 3.0])
    np.testing.assert_array_equal(a.schedule.contributions, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(b.schedule.contributions, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(b.schedule.discarded, [[0, 0], [1, 0]])
    for block in (a, b):  # every applied gradient was computed at the current point
      np.testing.assert_array_equal(block.schedule.staleness, 0)
      np.testing.assert_array_equal(block.schedule.microbatches_done, block.schedule.contributions)

  def test_rennala_applies_only_fresh_gradients(self):
    clock = helpers.clock(kbatch_async.KBatchAsync(4, max_delay=1), workers=P, seed=2, kind='exponential',
                          rate=100.0)
    block = clock.next_block(2000)
    np.testing.assert_array_equal(block.schedule.staleness, 0)
    np.testing.assert_array_equal(block.mean_staleness, 0)
    np.testing.assert_array_equal(block.schedule.contributions.sum(axis=1), 4)
    self.assertGreater(block.measurements['discarded'].sum(), 1000)  # the work in flight at each update

  def test_kbatch_sync_applies_only_fresh_gradients(self):
    clock = helpers.clock(kbatch_sync.KBatchSync(4), workers=P, seed=2, kind='exponential', rate=100.0)
    block = clock.next_block(2000)
    np.testing.assert_array_equal(block.schedule.staleness, 0)
    np.testing.assert_array_equal(block.schedule.refresh_view, True)  # every learner restarts on W_{t+1}
    np.testing.assert_array_equal(block.schedule.contributions.sum(axis=1), 4)


if __name__ == '__main__':
  absltest.main()
