"""WAGMA-SGD: groups, the wait-avoiding time rule, a sequential float64 reference, conditionals, config errors.

The math is replayed on least squares in a plain numpy loop (one model per worker, send buffers, groups from
the masks, fresh or stale per the schedule); the time rule against a brute-force replay of its formulas
(A_i = min_k c_k + popcount(k XOR i) a, fresh iff c_i <= A_i, group done at max_members A + allreduce(S)).
"""

import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless import config_errors as errors
from waitless.cluster.rules import sync
from waitless.algorithms import wagma
from waitless.cluster.rules import wagma as wagma_rule
from waitless.cluster import clock as clock_lib
from waitless.cluster.rules import activation
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import validation
from tests import harness
from tests import hlo
from tests.algorithms import reference
from tests.cluster import helpers

X = 0.01


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


def _groups(iteration, workers, group_size):
  ids = wagma.group_ids(iteration, workers, group_size)
  return sorted(sorted(np.flatnonzero(ids == g).tolist()) for g in np.unique(ids))


class GroupTest(parameterized.TestCase):

  def test_groups_from_the_spec(self):
    self.assertEqual(_groups(0, 8, 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
    self.assertEqual(_groups(1, 8, 4), [[0, 1, 4, 5], [2, 3, 6, 7]])
    self.assertEqual(wagma.group_masks(0, 8, 4), [1, 2])
    self.assertEqual(wagma.group_masks(1, 8, 4), [4, 1])

  def test_groups_partition_and_reach_everyone_within_log_s_p_iterations(self):
    for big_g in range(11):  # P up to 1024
      p = 1 << big_g
      for g in range(big_g + 1):
        s = 1 << g
        n = wagma.num_patterns(p, s)
        reach = -(-big_g // g) if g else None  # ceil(log_S P)
        for start in range(n):
          for t in range(start, start + n):
            ids = wagma.group_ids(t, p, s)
            np.testing.assert_array_equal(np.bincount(ids, minlength=p)[np.unique(ids)], s)  # groups of S
            self.assertEqual(wagma.group_masks(t, p, s), wagma.group_masks(t % n, p, s))     # n patterns
          if reach is None:
            continue
          known = np.eye(p, dtype=bool)  # known[i, j]: j's model has reached i
          for t in range(start, start + reach):
            ids = wagma.group_ids(t, p, s)
            for label in np.unique(ids):
              members = ids == label
              known[members] = known[members].any(axis=0)
          self.assertTrue(known.all(), f'P={p} S={s} from t={start}')

  def test_aligned_patterns_are_rotation_where_log2_s_divides_log2_p_and_fixed_elsewhere(self):
    """`ffallreduce_nh` (Shigangli/WAGMA-SGD, fflib3/src/colls/ffallreduce.c at 3cb5305): mask 1 << (step g),
    shifted once per round, step = t mod floor(G / g): rotation where g divides G, fixed groups where not."""
    for big_g in range(11):
      p = 1 << big_g
      for g in range(big_g + 1):
        s = 1 << g
        n = wagma.num_patterns(p, s, 'aligned')
        for t in range(12):
          masks = wagma.group_masks(t, p, s, 'aligned')
          want = [] if big_g == 0 else [1 << (((t % n) * g) + r) for r in range(g)]  # the C loop, per rank
          self.assertEqual(masks, want, f'P={p} S={s} t={t}')
          if g and big_g % g == 0:
            self.assertEqual(masks, wagma.group_masks(t, p, s))
          self.assertLess(max(masks, default=0), 1 << (n * g))  # the top G mod g bits never mix
    self.assertEqual(wagma.num_patterns(8, 4, 'aligned'), 1)
    self.assertEqual([_groups(t, 8, 4) for t in range(3)], [[[0, 1, 2, 3], [4, 5, 6, 7]],
                                                             [[0, 1, 4, 5], [2, 3, 6, 7]],
                                                             [[0, 2, 4, 6], [1, 3, 5, 7]]])
    for t in range(3):  # P = 8, S = 4: the authors' groups stay {0..3}, {4..7}
      self.assertEqual(wagma.group_ids(t, 8, 4, 'aligned').tolist(), [0, 0, 0, 0, 4, 4, 4, 4])
    self.assertEqual(wagma.num_patterns(16, 8, 'aligned'), 1)
    self.assertEqual(wagma.num_patterns(64, 8, 'aligned'), wagma.num_patterns(64, 8), 2)  # the authors' runs

  def test_num_patterns_and_default_group_size(self):
    self.assertEqual(wagma.num_patterns(8, 4), 3)
    self.assertEqual(wagma.num_patterns(16, 4), 2)
    self.assertEqual(wagma.num_patterns(1024, 32), 2)
    self.assertEqual(wagma.num_patterns(1, 1), 1)
    self.assertEqual([wagma.default_group_size(p) for p in (1, 2, 4, 8, 16, 64, 1024)], [1, 2, 2, 4, 4, 8, 32])


def brute_force_rule(clock, rule, iterations):
  """The rule's formulas written out per worker (O(P^2)); returns fresh, behind, end times per iteration.

  x_i is when worker i's model joins the collective: its start (rule='authors': W(t), exchanged under the
  gradient) or its finish c_i (step_then_average: W'). A worker that failed for good (its local step never
  finishes) is left out of its group: the group waits for and counts only its live members, and the lost
  worker's clock stays where it was.
  """
  p, s, a = clock.workers, rule.group_size, rule.activation_latency_s
  out, previous = [], np.zeros(p)
  for t in range(iterations):
    start = clock.times.copy()
    c = clock.work(np.arange(p), clock.times, rule.microbatches)
    live = np.isfinite(c)
    x = np.where(live, start, np.inf) if rule.rule == 'authors' else c
    if (t + 1) % rule.sync_every == 0 or s == p:
      fresh, behind = np.ones(p, bool), np.zeros(p, bool)
      end = np.array([max(c[i], x.max() + clock.network.allreduce(clock.model_bytes, p)) for i in range(p)])
    else:
      hops = np.array([[bin(k ^ i).count('1') for k in range(p)] for i in range(p)])
      act = np.array([min(x[k] + hops[i, k] * a for k in range(p)) for i in range(p)])
      if not rule.wait_avoiding:
        act = x
      fresh = live & (x <= act)
      behind = ~fresh & live & (previous > act)
      ids = wagma.group_ids(rule.pattern(t, p), p, s, rule.group_patterns)
      done = np.array([act[(ids == ids[i]) & live].max()
                       + clock.network.allreduce(clock.model_bytes, int(((ids == ids[i]) & live).sum()))
                       for i in range(p)])
      end = np.where(live, np.where(fresh & (rule.rule != 'authors'), done, np.maximum(c, done)), clock.times)
    previous = x
    clock.times[:] = end
    out.append((fresh, behind, end.copy()))
  return out


class TimeRuleTest(parameterized.TestCase):

  def test_activation_times_are_hypercube_shortest_paths(self):
    rng = np.random.default_rng(0)
    for p in (1, 2, 8, 32):
      c = rng.exponential(1.0, p)
      got = activation.activation_times(c, 0.3)
      want = [min(c[k] + 0.3 * bin(k ^ i).count('1') for k in range(p)) for i in range(p)]
      np.testing.assert_allclose(got, want, rtol=1e-14)

  @parameterized.named_parameters(*[
      (f'{name}_{rule}', stragglers, network, {**options, 'rule': rule}) for rule in wagma.RULES
      for name, stragglers, network, options in (
          ('lognormal_delays', dict(kind='lognormal', sigma=0.2, delayed_workers=2, delay_s=0.03), {}, {}),
          ('alpha_beta', dict(kind='lognormal', sigma=0.02), dict(kind='alpha_beta', latency_s=1e-4), {}),
          ('slow_network', dict(kind='lognormal', sigma=0.2),
           dict(kind='alpha_beta', latency_s=1e-3, bandwidth_gbps=0.5), {}),
          ('large_latency', dict(kind='lognormal', sigma=0.02), {}, dict(activation_latency_s=2e-4)),
          ('fixed_groups', dict(kind='exponential', rate=100.0), {}, dict(fixed_groups=True)),
          ('blocking_groups', dict(kind='exponential', rate=100.0), {}, dict(wait_avoiding=False)),
          ('micro_batches', dict(kind='exponential', rate=100.0), {}, dict(microbatches=3)),
      )])
  def test_matches_brute_force(self, stragglers, network, options):
    rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=5, **options)
    got = helpers.clock(rule, workers=16, network=network, **stragglers)
    block = got.next_block(30)
    want = brute_force_rule(helpers.clock(rule, workers=16, network=network, **stragglers), rule, 30)
    for t, (fresh, behind, _) in enumerate(want):
      np.testing.assert_array_equal(block.schedule.fresh[t], fresh, err_msg=f'iteration {t}')
      np.testing.assert_array_equal(block.schedule.behind[t], behind, err_msg=f'iteration {t}')
    np.testing.assert_allclose(block.sim_time, np.maximum.accumulate([end.max() for *_, end in want]), rtol=1e-12)
    np.testing.assert_allclose(got.times, want[-1][2], rtol=1e-12)
    np.testing.assert_allclose(block.measurements['fresh_share'], block.schedule.fresh.mean(axis=1))
    np.testing.assert_array_equal(block.measurements['behind'], block.schedule.behind.sum(axis=1))
    patterns = block.schedule.pattern
    np.testing.assert_array_equal(patterns, 0 if options.get('fixed_groups') else np.arange(30) % 2)
    if not options.get('wait_avoiding', True):
      self.assertTrue(block.schedule.fresh.all())

  @parameterized.named_parameters(*[(f'{name}_{rule}', wait_avoiding, rule) for rule in wagma.RULES
                                    for name, wait_avoiding in (('wait_avoiding', True), ('blocking_groups', False))])
  def test_a_lost_worker_is_left_out_until_the_global_average(self, wait_avoiding, rule_name):
    """Worker 5 of 16 fails for good during iteration 2: its groups go on with their 3 live members (they
    neither wait for nor count it) until the global average of iteration 11, where the run stops with one line."""
    rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=12, wait_avoiding=wait_avoiding, rule=rule_name)
    stragglers = dict(kind='lognormal', sigma=0.2, fail_worker=5, fail_at_s=0.025)
    network = dict(kind='alpha_beta', latency_s=1e-4)
    got = helpers.clock(rule, workers=16, network=network, **stragglers)
    block = got.next_block(11)
    want = brute_force_rule(helpers.clock(rule, workers=16, network=network, **stragglers), rule, 11)
    live = block.schedule.live
    self.assertTrue(live[:2].all())
    np.testing.assert_array_equal(live[2:], np.broadcast_to(np.arange(16) != 5, (9, 16)))
    np.testing.assert_array_equal(block.schedule.microbatches_done[2:, 5], 0)
    for t, (fresh, behind, _) in enumerate(want):
      np.testing.assert_array_equal(block.schedule.fresh[t], fresh, err_msg=f'iteration {t}')
      np.testing.assert_array_equal(block.schedule.behind[t], behind, err_msg=f'iteration {t}')
      ids = wagma.group_ids(int(block.schedule.pattern[t]), 16, 4)
      np.testing.assert_array_equal(block.schedule.members[t], [(live[t] & (ids == g)).sum() for g in ids])
    np.testing.assert_allclose(block.sim_time, np.maximum.accumulate([end[np.isfinite(end)].max()
                                                                       for *_, end in want]), rtol=1e-12)
    np.testing.assert_allclose(got.times, want[-1][2], rtol=1e-12)
    self.assertTrue(np.isfinite(got.times).all())
    self.assertLess(got.times[5], 0.03)  # the lost worker's clock stays where it failed
    self.assertEqual(block.idle[2:, 5].max(), 0.0)
    self.assertGreater(got.sim_time, 0.1)
    with self.assertRaisesRegex(clock_lib.StalledError, r'^worker\(s\) \[5\] failed for good at 0.025 s of '
                                r'simulated time, and WaitAvoidingGroups waits for every worker at iteration 11 '):
      got.next_block(1)

  @parameterized.named_parameters(*[
      (f'{name}_{rule}', network, latency, rule) for rule in wagma.RULES for name, network, latency in (
          ('ideal_a0', {}, 0.0), ('ideal', {}, 1e-5), ('alpha_beta', dict(kind='alpha_beta', latency_s=1e-4), 1e-5))])
  def test_constant_compute_is_always_fresh(self, network, latency, rule_name):
    rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=5, activation_latency_s=latency, rule=rule_name)
    block = helpers.clock(rule, workers=16, base_s=X, network=network).next_block(40)
    self.assertTrue(block.schedule.fresh.all())
    self.assertFalse(block.schedule.behind.any())
    np.testing.assert_array_equal(block.measurements['fresh_share'], 1.0)

  def test_noise_makes_most_contributions_stale(self):
    """P = 16, S = 4, ideal network, default a: the fresh share falls from 1 to about 1/16 with any noise."""
    shares = {}
    for sigma in (0.0, 0.02, 0.2):
      rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=10)
      block = helpers.clock(rule, workers=16, kind='lognormal', sigma=sigma, base_s=X).next_block(200)
      shares[sigma] = block.measurements['fresh_share'][~block.schedule.global_average].mean()
    self.assertEqual(shares[0.0], 1.0)
    self.assertLess(shares[0.02], 0.15)
    self.assertLess(shares[0.2], 0.15)

  def test_larger_activation_latency_keeps_more_workers_fresh(self):
    def share(a):
      rule = wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=10, activation_latency_s=a)
      block = helpers.clock(rule, workers=16, kind='lognormal', sigma=0.02, base_s=X).next_block(200)
      return block.measurements['fresh_share'].mean()
    self.assertLess(share(0.0), share(1e-4))

  @parameterized.named_parameters(('fast_network', 1e-4), ('slow_network', 2e-2))
  def test_the_authors_order_costs_max_of_compute_and_exchange(self, latency):
    """By hand, constant compute X (everyone fresh): the authors' order posts W(t) at the start, so an iteration
    costs max(X, allreduce(S)) (group) or max(X, allreduce(P)) (global), where step_then_average pays the sum."""
    ends, network = {}, dict(kind='alpha_beta', latency_s=latency)
    for rule in wagma.RULES:
      clock = helpers.clock(wagma_rule.WaitAvoidingGroups(group_size=4, sync_every=5, rule=rule), workers=16, base_s=X,
                            network=network)
      block = clock.next_block(20)
      group, every = (clock.network.allreduce(clock.model_bytes, k) for k in (4, 16))
      self.assertTrue(block.schedule.fresh.all())
      if rule == 'authors':
        want = np.where(block.schedule.global_average, max(X, every), max(X, group))
        np.testing.assert_allclose(block.idle, np.broadcast_to((want - X)[:, None], block.idle.shape), atol=1e-15)
      else:
        want = np.where(block.schedule.global_average, X + every, X + group)
      np.testing.assert_allclose(block.duration, want, rtol=1e-9)
      ends[rule] = block.sim_time[-1]
    self.assertLess(ends['authors'], ends['step_then_average'])
    # 0.1 ms of latency: the exchange is hidden under the compute; 20 ms: the compute under the exchange.
    self.assertEqual(group > X, latency > 1e-3)

  def test_the_authors_global_average_overlaps_each_workers_step(self):
    """tau = 1, authors: end_i = max(c_i, max_j start_j + allreduce(P)) (no barrier on the finish times)."""
    rule = wagma_rule.WaitAvoidingGroups(2, 1)
    kwargs = dict(workers=8, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', latency_s=5e-4))
    clock, by_hand = helpers.clock(rule, **kwargs), helpers.clock(rule, **kwargs)
    every = by_hand.network.allreduce(by_hand.model_bytes, 8)
    waited, spread = [], []
    for _ in range(6):
      block = clock.next_block(1)
      self.assertTrue(block.schedule.global_average.all())
      start = by_hand.times.copy()
      c = by_hand.work(np.arange(8), by_hand.times, 1)
      by_hand.times[:] = [max(c[i], start.max() + every) for i in range(8)]
      waited.append(c < start.max() + every)
      np.testing.assert_allclose(clock.times, by_hand.times, rtol=1e-12)
      spread.append(np.ptp(clock.times))
    self.assertTrue(np.any(waited) and not np.all(waited))  # both terms of the max are taken
    self.assertGreater(max(spread), 0)  # workers leave the average at different times

  def test_group_size_p_and_tau_one_are_global_averages(self):
    for rule in (wagma_rule.WaitAvoidingGroups(8, 5, rule='step_then_average'),
                 wagma_rule.WaitAvoidingGroups(2, 1, rule='step_then_average')):
      kwargs = dict(workers=8, kind='exponential', rate=100.0, delayed_workers=2, delay_s=0.02)
      block = helpers.clock(rule, **kwargs).next_block(12)
      self.assertTrue(block.schedule.global_average.all())
      self.assertTrue(block.schedule.fresh.all())
      barrier = helpers.clock(sync.Barrier(), **kwargs).next_block(12)
      np.testing.assert_allclose(block.sim_time, barrier.sim_time, rtol=1e-12)

  def test_rule_errors(self):
    with self.assertRaisesRegex(ValueError, "rule='overlap' must be one of"):
      wagma_rule.WaitAvoidingGroups(4, 4, rule='overlap')
    with self.assertRaisesRegex(ValueError, "group_patterns='fixed' must be one of"):
      wagma_rule.WaitAvoidingGroups(4, 4, group_patterns='fixed')
    with self.assertRaisesRegex(ValueError, 'activation_latency_s'):
      wagma_rule.WaitAvoidingGroups(4, 4, activation_latency_s=-1e-6)
    with self.assertRaisesRegex(ValueError, 'group_size'):
      wagma_rule.WaitAvoidingGroups(3, 4)
    with self.assertRaisesRegex(ValueError, 'workers'):
      helpers.clock(wagma_rule.WaitAvoidingGroups(2, 4), workers=6).next_block(1)
    with self.assertRaisesRegex(ValueError, 'group_size'):
      helpers.clock(wagma_rule.WaitAvoidingGroups(8, 4), workers=4).next_block(1)


_STRAGGLERS = {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.3, 'stragglers.delayed_workers': 2,
               'stragglers.delay_s': 0.02}


class AuthorsPort:
  """A literal float64 port of the authors' WAGMA-SGD step, one object for all P ranks.

  Shigangli/WAGMA-SGD at 3cb53050a309fa461b01361fc173a91339b05556:
  - test-models/tf-models-r1.11/official/utils/opt_wagma_sgd_imagenet.py, `WAGMASGDOptimizer.apply_gradients`:
    per variable `model_avg = op(var, last_var)` (the custom op `allreducef`), `tf.assign(var, model_avg)`,
    then, under a control dependency on the assigns, `self.optimizer.apply_gradients(grads_and_vars)`: the
    momentum step of the gradient taken at the var before the average.
  - the same file, `allreducef::forward`: `memcpy(grad_ptrs, input)`, post and wait the solo allreduce of
    schedule step `((counter - 644) / OPS) % STEPS`, STEPS = floor(log2 P / log2 S); then
    `output = sum / 64` (P) when `step % (LIMITER + 1) == LIMITER`, else `output = (sum + input*1) / 9` (S + 1).
  - WAGMA-SGD-modules/fflib3/src/colls/ffallreduce.c, `ffallreduce_nh`: recursive doubling from
    `mask = 1 << (step*groupr)`, `mask <<= 1` per round, groupr = log2 S rounds, `rb += rb of rank^mask`.
  - fflib3/src/colls/ffsolo_allreduce.c: the allreduce is run by whichever rank activates it first; a rank that
    has not called `forward` yet contributes what its `grad_ptrs` holds (its last memcpy: its previous var).
  The optimizer is tf.train.MomentumOptimizer: accum <- momentum accum + g; var <- var - lr accum
  (`reference.MomentumSGD`). Iteration t here is the authors' `(counter - 644) / OPS`; LIMITER = tau - 1.
  """

  def __init__(self, models, workers, group_size, tau, lr, momentum):
    self.p, self.s, self.limiter = workers, group_size, tau - 1
    self.var = [[np.array(x, np.float64) for x in m] for m in models]
    self.grad_ptrs = [[x.copy() for x in m] for m in self.var]  # W_0 at first (the project's init)
    self.opts = [reference.MomentumSGD(lr, momentum) for _ in range(workers)]
    phases, gphases = int(np.ceil(np.log2(workers))), int(np.ceil(np.log2(group_size)))
    self.steps = max(phases // gphases, 1) if gphases else 1

  def _allreduce_nh(self, step):
    """`ffallreduce_nh` on every rank at once: rb = own grad_ptrs, then groupr rounds of rb += rb[rank ^ mask]."""
    rb = [[x.copy() for x in buf] for buf in self.grad_ptrs]
    mask = 1 << (step * int(np.log2(self.s)))
    for _ in range(int(np.log2(self.s))):
      rb = [[a + b for a, b in zip(rb[rank], rb[rank ^ mask])] if (rank ^ mask) < self.p else rb[rank]
            for rank in range(self.p)]
      mask <<= 1
    return rb

  def iteration(self, t, grads, fresh):
    """One `apply_gradients` on every rank: grads[i] taken at var[i]; fresh[i]: rank i's memcpy came before the
    allreduce ran (else its progress thread sent the old grad_ptrs)."""
    inputs = [[x.copy() for x in v] for v in self.var]
    limiter = t % (self.limiter + 1) == self.limiter
    for i in range(self.p):
      if fresh[i] or limiter:  # the synchronous allreduce of the LIMITER iteration waits for every memcpy
        self.grad_ptrs[i] = [x.copy() for x in inputs[i]]
    if limiter:
      total = [sum(self.grad_ptrs[j][k] for j in range(self.p)) for k in range(len(inputs[0]))]
      output = [[x / self.p for x in total] for _ in range(self.p)]
    else:
      sums = self._allreduce_nh(t % self.steps)
      output = [[(x + y * 1) / (self.s + 1) for x, y in zip(sums[i], inputs[i])] for i in range(self.p)]
    for i in range(self.p):
      if not (fresh[i] or limiter):  # the late rank's memcpy, after its progress thread ran the allreduce
        self.grad_ptrs[i] = [x.copy() for x in inputs[i]]
      self.var[i] = self.opts[i].step(output[i], grads[i])  # tf.assign(var, model_avg), then the momentum step
    return self.var


class ReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('s2_rotating_momentum', 4, 2, 4, 0.9, {}),
      ('s4_aligned_groups', 8, 4, 5, 0.9, {'algorithm.group_patterns': 'aligned'}),
      ('s4_vmapped_tau11', 2, 4, 11, 0.0, {'algorithm.group_patterns': 'aligned'}),
  )
  def test_default_matches_a_literal_port_of_the_authors_code(self, devices, group_size, tau, momentum,
                                                              overrides):
    iterations, p = 12, 8
    with jax.enable_x64(True):
      config = _f64(f'wagma,group_size={group_size},sync_every={tau}', workers=p, devices=devices,
                    **{'optimizer.momentum': momentum, **_STRAGGLERS, **overrides})
      self.assertEqual(config.algorithm.rule, 'authors')  # the default
      traj = harness.run_iterations(config, iterations, block=4)
    fresh_all = np.stack([s.fresh for s in traj.schedules])
    globals_ = np.array([bool(s.global_average) for s in traj.schedules])
    self.assertTrue((~fresh_all[~globals_]).any(), 'the schedule has no stale worker')
    self.assertTrue(fresh_all[~globals_].any(), 'the schedule has no fresh worker')
    port = AuthorsPort([reference.unpack(traj.initial_params, i) for i in range(p)], p, group_size, tau,
                       config.optimizer.learning_rate, momentum)
    for t in range(iterations):
      grads = []
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(port.var[i][0], float(port.var[i][1]), batch['image'][0], batch['label'][0])
        grads.append([gw, np.float64(gb)])
      if not globals_[t]:  # the schedule's groups are the authors' (`ffallreduce_nh` masks)
        ids = np.arange(p) & ~sum(1 << ((t % port.steps) * int(np.log2(group_size)) + r)
                                  for r in range(int(np.log2(group_size))))
        np.testing.assert_array_equal(
            wagma.group_ids(int(traj.schedules[t].pattern), p, group_size, 'aligned'), ids)
      models = port.iteration(t, grads, traj.schedules[t].fresh)
      if (t + 1) % 4 == 0:
        for i in range(p):
          got_w, got_b = reference.unpack(traj.params[t // 4], i)
          np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
          np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)

  @parameterized.named_parameters(*[
      (f'{name}_{rule}', devices, group_size, tau, momentum, {**overrides, 'algorithm.rule': rule})
      for rule in wagma.RULES for name, devices, group_size, tau, momentum, overrides in (
          ('stragglers', 8, 4, 3, 0.0, _STRAGGLERS),
          ('stragglers_vmapped_momentum', 4, 2, 4, 0.9, _STRAGGLERS),
          ('fixed_groups', 2, 4, 5, 0.0, {'stragglers.kind': 'exponential', 'algorithm.fixed_groups': True}),
          ('no_stragglers', 8, 4, 3, 0.0, {}),
          # Worker 3 fails for good during iteration 7, after the global average of iteration 6 (the next, 13,
          # is beyond the run): from then on it is frozen and its groups average over their 3 live members.
          ('lost_worker_vmapped_momentum', 4, 4, 7, 0.9, {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.05,
                                                          'stragglers.fail_worker': 3, 'stragglers.fail_at_s': 0.075}),
      )])
  def test_matches_sequential_reference(self, devices, group_size, tau, momentum, overrides):
    """Both rules, one loop: W posted (authors: W(t); step_then_average: W'), its group average (divisor
    n + 1 always, or n fresh / n + 1 stale), then (authors) the step; n = live members."""
    iterations, p = 12, 8
    authors = overrides['algorithm.rule'] == 'authors'
    with jax.enable_x64(True):
      config = _f64(f'wagma,group_size={group_size},sync_every={tau}', workers=p, devices=devices,
                    **{'optimizer.momentum': momentum, **overrides})
      traj = harness.run_iterations(config, iterations, block=4)
    fresh_all = np.stack([s.fresh for s in traj.schedules])
    globals_ = np.array([bool(s.global_average) for s in traj.schedules])
    np.testing.assert_array_equal(np.flatnonzero(globals_), np.arange(tau - 1, iterations, tau))
    if len(overrides) > 1:
      self.assertTrue((~fresh_all[~globals_]).any(), 'the schedule has no stale worker')
      self.assertTrue(fresh_all[~globals_].any(), 'the schedule has no fresh worker')
    else:
      self.assertTrue(fresh_all.all())  # no stragglers: the stale branch is never taken

    live_all = np.stack([s.live for s in traj.schedules])
    if 'stragglers.fail_worker' in overrides:
      lost = np.flatnonzero(~live_all[:, 3])
      np.testing.assert_array_equal(lost, np.arange(lost[0], iterations))  # lost for good, after the global average
      self.assertGreater(lost[0], tau - 1)
      self.assertTrue(live_all[:, np.arange(p) != 3].all())
    else:
      self.assertTrue(live_all.all())

    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    buffers = [[m[0].copy(), m[1]] for m in models]
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]
    fixed = config.algorithm.fixed_groups
    for t in range(iterations):
      live = traj.schedules[t].live
      stepped = []
      for i in range(p):
        if not live[i]:  # a lost worker computes nothing and its optimizer state is frozen
          stepped.append(None)
          continue
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(models[i][0], models[i][1], batch['image'][0], batch['label'][0])
        stepped.append(opts[i].step(models[i], [gw, np.float64(gb)]))
      fresh = traj.schedules[t].fresh
      posted = models if authors else stepped
      if globals_[t]:
        mean = [np.mean([m[k] for m in posted], axis=0) for k in range(2)]
        averaged = [list(mean) for _ in range(p)]
      else:
        ids = wagma.group_ids(0 if fixed else t, p, group_size)
        np.testing.assert_array_equal(wagma.group_ids(int(traj.schedules[t].pattern), p, group_size), ids)
        contribution = [posted[i] if fresh[i] else buffers[i] for i in range(p)]
        averaged = []
        for i in range(p):
          if not live[i]:
            averaged.append(None)
            continue
          group = [j for j in np.flatnonzero(ids == ids[i]) if live[j]]
          self.assertEqual(traj.schedules[t].members[i], len(group))
          total = [sum(contribution[j][k] for j in group) for k in range(2)]
          averaged.append([total[k] / len(group) if fresh[i] and not authors
                           else (total[k] + posted[i][k]) / (len(group) + 1) for k in range(2)])
      new_models = []
      for i in range(p):
        if not live[i]:
          new_models.append(models[i])
        elif authors:  # A_i + U_i(g_i(W_i(t))): the step the optimizer took from W_i(t)
          new_models.append([a + (s - m) for a, s, m in zip(averaged[i], stepped[i], models[i])])
        else:
          new_models.append(averaged[i])
      buffers = [posted[i] if live[i] else buffers[i] for i in range(p)]
      models = new_models
      if (t + 1) % 4 == 0:  # params are recorded per block of 4
        for i in range(p):
          got_w, got_b = reference.unpack(traj.params[t // 4], i)
          np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
          np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)

  @parameterized.named_parameters(('group_size_p', 'group_size=8,sync_every=5'), ('tau_one', 'sync_every=1'))
  def test_global_average_every_iteration_is_local_sgd_h1_when_stepping_first(self, arg):
    stragglers = {**_STRAGGLERS, 'optimizer.momentum': 0.9}
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(a, workers=8, devices=4, **stragglers), 6, block=3)
              for a in (f'wagma,rule=step_then_average,{arg}', 'local_sgd,local_steps=1')]
    for a, b in zip(runs[0].params, runs[1].params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  @parameterized.named_parameters(('group_size_p', 'group_size=8,sync_every=5'), ('tau_one', 'sync_every=1'))
  def test_global_average_every_iteration_under_the_authors_rule(self, arg):
    """Authors' order, every iteration global: W_i(t+1) = mean_j W_j(t) + U_i(g_i(W_i(t))) (D-PSGD's overlap
    order on the complete graph), not local SGD with H = 1: the workers differ by their own last step, and the
    worker mean moves by the mean step, U_i taken at W_i(t) = mean W(t-1) + U_i(t-1) in place of the mean."""
    stragglers = {**_STRAGGLERS, 'optimizer.momentum': 0.0}
    iterations = 6
    with jax.enable_x64(True):
      config = _f64(f'wagma,{arg}', workers=8, devices=4, **stragglers)
      traj = harness.run_iterations(config, iterations, block=1)
      local = harness.run_iterations(_f64('local_sgd,local_steps=1', workers=8, devices=4, **stragglers),
                                     iterations, block=1)
    lr = config.optimizer.learning_rate
    models = [reference.unpack(traj.initial_params, i) for i in range(8)]
    for t in range(iterations):
      self.assertTrue(bool(traj.schedules[t].global_average))
      steps = []
      for i in range(8):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(models[i][0], models[i][1], batch['image'][0], batch['label'][0])
        steps.append((-lr * gw, -lr * gb))
      mean = [np.mean([m[k] for m in models], axis=0) for k in range(2)]
      models = [(mean[0] + dw, mean[1] + db) for dw, db in steps]
      for i in range(8):
        got_w, got_b = reference.unpack(traj.params[t], i)
        np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
        np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)
    spread = np.ptp(np.asarray(jax.tree.leaves(traj.params[-1])[0]), axis=0).max()
    self.assertGreater(spread, 1e-8)  # no consensus after the average: each worker's own step follows it
    gap = np.abs(np.asarray(jax.tree.leaves(traj.params[-1])[0]).mean(0)
                 - np.asarray(jax.tree.leaves(local.params[-1])[0]).mean(0)).max()
    self.assertGreater(gap, 1e-8)  # and the worker mean is not local SGD's

  @parameterized.named_parameters(*[(rule, rule) for rule in wagma.RULES])
  def test_workers_on_fewer_devices_give_the_same_trajectory(self, rule):
    stragglers = {'stragglers.kind': 'exponential', 'stragglers.delayed_workers': 2, 'stragglers.delay_s': 0.02}
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(f'wagma,group_size=4,sync_every=5,rule={rule}', workers=16, devices=d,
                                          **stragglers), 10, block=5) for d in (8, 2, 1)]
    for other in runs[1:]:
      for a, b in zip(runs[0].params, other.params):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)



_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')


def _permute_masks(text: str) -> dict[str, set[int]]:
  """Computation name -> the XOR masks (source ^ target) of its collective-permutes."""
  out, current = {}, None
  for line in text.splitlines():
    match = hlo._COMPUTATION.match(line)
    if match:
      current = match.group(1)
      out[current] = set()
    elif current and 'collective-permute' in line:
      for pairs in _PAIRS.findall(line):
        out[current] |= {int(a) ^ int(b) for a, b in re.findall(r'\{(\d+),(\d+)\}', pairs)}
  return out


class ConditionalTest(parameterized.TestCase):

  @parameterized.named_parameters(('one_worker_per_device', 8, 8), ('two_workers_per_device', 8, 4),
                                  ('four_workers_per_device', 16, 4))
  def test_each_iteration_runs_one_patterns_exchanges(self, workers, devices):
    config = harness.synthetic_config('wagma,group_size=4', workers=workers, devices=devices, steps_per_call=4)
    run = setup.build(config)
    state = setup.init_state(run)
    _, nbytes = setup.param_count_and_bytes(state.params)
    block = setup.clock_for(run, nbytes).next_block(4)
    inputs, _ = inputs_lib.block_inputs(run, block, np.zeros(workers, np.int64), 0)
    text = block_step_lib.BlockStep(run).lower(state, *inputs).compile().as_text()
    program, masks = hlo.parse(text), _permute_masks(text)
    self.assertEqual(program.collectives_outside_conditionals(), [])
    n = wagma.num_patterns(workers, 4)
    switches = [b for b in program.branches if len(b) == n + 1]
    self.assertLen(switches, 1)
    local = workers // devices
    for k, branch in enumerate(switches[0]):
      inside = program.reachable([branch])
      ops = {op.removesuffix('-start') for op in program.collectives(inside)}
      if k == n:  # the global average
        self.assertEqual(ops, {'all-reduce'})
        continue
      # Only this pattern's device exchanges (the bits above the local slot; the local ones are not collectives).
      want = {m // local for m in wagma.group_masks(k, workers, 4) if m >= local}
      self.assertEqual(ops, {'collective-permute'} if want else set(), f'pattern {k}')
      self.assertEqual(set().union(*(masks.get(c, set()) for c in inside)), want, f'pattern {k}')


class ConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('workers_not_power_of_two', dict(workers=12, devices=4), 'workers=12'),
      ('group_size_not_power_of_two', dict(arg='wagma,group_size=3'), 'algorithm.group_size=3'),
      ('group_size_above_workers', dict(arg='wagma,group_size=16'), 'algorithm.group_size=16'),
      ('tau_below_one', dict(arg='wagma,sync_every=0'), 'algorithm.sync_every=0'),
      ('negative_activation_latency', dict(arg='wagma,activation_latency_s=-1e-06'),
       'algorithm.activation_latency_s=-1e-06'),
      ('unknown_rule', dict(arg='wagma,rule=overlap'),
       "algorithm.rule='overlap' is not allowed: must be one of authors, step_then_average"),
      ('unknown_group_patterns', dict(arg='wagma,group_patterns=fixed'),
       "algorithm.group_patterns='fixed' is not allowed: must be one of rotate, aligned"),
  )
  def test_one_line_error_naming_the_field(self, overrides, message):
    overrides = dict(overrides)
    config = harness.synthetic_config(overrides.pop('arg', 'wagma'), **{'workers': 8, 'devices': 8, **overrides})
    with self.assertRaises(errors.ConfigError) as caught:
      validation.validate(config)
    self.assertTrue(str(caught.exception).startswith(message), str(caught.exception))
    self.assertNotIn('\n', str(caught.exception))

  def test_defaults(self):
    config = harness.synthetic_config('wagma', workers=16, devices=8)
    validation.validate(config)
    rule = wagma_rule.time_rule(config)
    self.assertEqual((rule.group_size, rule.sync_every, rule.rule, rule.group_patterns), (4, 10, 'authors', 'rotate'))
    self.assertGreater(rule.activation_latency_s, 0)


if __name__ == '__main__':
  absltest.main()
