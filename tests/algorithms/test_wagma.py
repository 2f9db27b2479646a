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

import config_errors as errors
from algorithms import sync
from algorithms import wagma
from cluster import clock as clock_lib
from cluster.rules import activation
from experiments import train
from experiments import validation
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

  def test_num_patterns_and_default_group_size(self):
    self.assertEqual(wagma.num_patterns(8, 4), 3)
    self.assertEqual(wagma.num_patterns(16, 4), 2)
    self.assertEqual(wagma.num_patterns(1024, 32), 2)
    self.assertEqual(wagma.num_patterns(1, 1), 1)
    self.assertEqual([wagma.default_group_size(p) for p in (1, 2, 4, 8, 16, 64, 1024)], [1, 2, 2, 4, 4, 8, 32])


def brute_force_rule(clock, rule, iterations):
  """The rule's formulas written out per worker (O(P^2)); returns fresh, behind, end times per iteration.

  A worker that failed for good (its local step never finishes) is left out of its group: the group waits for
  and counts only its live members, and the lost worker's clock stays where it was.
  """
  p, s, a = clock.workers, rule.group_size, rule.activation_latency_s
  out, previous = [], np.zeros(p)
  for t in range(iterations):
    c = clock.work(np.arange(p), clock.times, rule.microbatches)
    live = np.isfinite(c)
    if (t + 1) % rule.period == 0 or s == p:
      fresh, behind = np.ones(p, bool), np.zeros(p, bool)
      end = np.full(p, c.max() + clock.network.allreduce(clock.model_bytes, p))
    else:
      hops = np.array([[bin(k ^ i).count('1') for k in range(p)] for i in range(p)])
      act = np.array([min(c[k] + hops[i, k] * a for k in range(p)) for i in range(p)])
      if not rule.wait_avoiding:
        act = c
      fresh = live & (c <= act)
      behind = ~fresh & live & (previous > act)
      ids = wagma.group_ids(rule.pattern(t, p), p, s)
      done = np.array([act[(ids == ids[i]) & live].max()
                       + clock.network.allreduce(clock.model_bytes, int(((ids == ids[i]) & live).sum()))
                       for i in range(p)])
      end = np.where(live, np.where(fresh, done, np.maximum(c, done)), clock.times)
    previous = c
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

  @parameterized.named_parameters(
      ('lognormal_delays', dict(kind='lognormal', sigma=0.2, delayed_workers=2, delay_s=0.03), {}, {}),
      ('alpha_beta', dict(kind='lognormal', sigma=0.02), dict(kind='alpha_beta', latency_s=1e-4), {}),
      ('large_latency', dict(kind='lognormal', sigma=0.02), {}, dict(activation_latency_s=2e-4)),
      ('fixed_groups', dict(kind='exponential', rate=100.0), {}, dict(fixed_groups=True)),
      ('blocking_groups', dict(kind='exponential', rate=100.0), {}, dict(wait_avoiding=False)),
      ('micro_batches', dict(kind='exponential', rate=100.0), {}, dict(microbatches=3)),
  )
  def test_matches_brute_force(self, stragglers, network, options):
    rule = wagma.WaitAvoidingGroups(group_size=4, period=5, **options)
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

  @parameterized.named_parameters(('wait_avoiding', True), ('blocking_groups', False))
  def test_a_lost_worker_is_left_out_until_the_global_average(self, wait_avoiding):
    """Worker 5 of 16 fails for good during iteration 2: its groups go on with their 3 live members (they
    neither wait for nor count it) until the global average of iteration 11, where the run stops with one line."""
    rule = wagma.WaitAvoidingGroups(group_size=4, period=12, wait_avoiding=wait_avoiding)
    stragglers = dict(kind='lognormal', sigma=0.2, fail_worker=5, fail_at_s=0.025)
    network = dict(kind='alpha_beta', latency_s=1e-4)
    got = helpers.clock(rule, workers=16, network=network, **stragglers)
    block = got.next_block(11)
    want = brute_force_rule(helpers.clock(rule, workers=16, network=network, **stragglers), rule, 11)
    live = block.schedule.live
    self.assertTrue(live[:2].all())
    np.testing.assert_array_equal(live[2:], np.broadcast_to(np.arange(16) != 5, (9, 16)))
    np.testing.assert_array_equal(block.schedule.microbatches_done[2:, 5], 0)
    for t, (fresh, behind, end) in enumerate(want):
      np.testing.assert_array_equal(block.schedule.fresh[t], fresh, err_msg=f'iteration {t}')
      np.testing.assert_array_equal(block.schedule.behind[t], behind, err_msg=f'iteration {t}')
      ids = block.schedule.group[t]
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

  @parameterized.named_parameters(
      ('ideal_a0', {}, 0.0), ('ideal', {}, 1e-5), ('alpha_beta', dict(kind='alpha_beta', latency_s=1e-4), 1e-5))
  def test_constant_compute_is_always_fresh(self, network, latency):
    rule = wagma.WaitAvoidingGroups(group_size=4, period=5, activation_latency_s=latency)
    block = helpers.clock(rule, workers=16, base_s=X, network=network).next_block(40)
    self.assertTrue(block.schedule.fresh.all())
    self.assertFalse(block.schedule.behind.any())
    np.testing.assert_array_equal(block.measurements['fresh_share'], 1.0)

  def test_noise_makes_most_contributions_stale(self):
    """P = 16, S = 4, ideal network, default a: the fresh share falls from 1 to about 1/16 with any noise."""
    shares = {}
    for sigma in (0.0, 0.02, 0.2):
      rule = wagma.WaitAvoidingGroups(group_size=4, period=10)
      block = helpers.clock(rule, workers=16, kind='lognormal', sigma=sigma, base_s=X).next_block(200)
      shares[sigma] = block.measurements['fresh_share'][~block.schedule.global_average].mean()
    self.assertEqual(shares[0.0], 1.0)
    self.assertLess(shares[0.02], 0.15)
    self.assertLess(shares[0.2], 0.15)

  def test_larger_activation_latency_keeps_more_workers_fresh(self):
    def share(a):
      rule = wagma.WaitAvoidingGroups(group_size=4, period=10, activation_latency_s=a)
      block = helpers.clock(rule, workers=16, kind='lognormal', sigma=0.02, base_s=X).next_block(200)
      return block.measurements['fresh_share'].mean()
    self.assertLess(share(0.0), share(1e-4))

  def test_group_size_p_and_tau_one_are_global_averages(self):
    for rule in (wagma.WaitAvoidingGroups(8, 5), wagma.WaitAvoidingGroups(2, 1)):
      kwargs = dict(workers=8, kind='exponential', rate=100.0, delayed_workers=2, delay_s=0.02)
      block = helpers.clock(rule, **kwargs).next_block(12)
      self.assertTrue(block.schedule.global_average.all())
      self.assertTrue(block.schedule.fresh.all())
      barrier = helpers.clock(sync.Barrier(), **kwargs).next_block(12)
      np.testing.assert_allclose(block.sim_time, barrier.sim_time, rtol=1e-12)

  def test_rule_errors(self):
    with self.assertRaisesRegex(ValueError, 'activation_latency_s'):
      wagma.WaitAvoidingGroups(4, 4, activation_latency_s=-1e-6)
    with self.assertRaisesRegex(ValueError, 'group_size'):
      wagma.WaitAvoidingGroups(3, 4)
    with self.assertRaisesRegex(ValueError, 'workers'):
      helpers.clock(wagma.WaitAvoidingGroups(2, 4), workers=6).next_block(1)
    with self.assertRaisesRegex(ValueError, 'group_size'):
      helpers.clock(wagma.WaitAvoidingGroups(8, 4), workers=4).next_block(1)


class ReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('stragglers', 8, 4, 3, 0.0, {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.3,
                                     'stragglers.delayed_workers': 2, 'stragglers.delay_s': 0.02}),
      ('stragglers_vmapped_momentum', 4, 2, 4, 0.9, {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.3,
                                                     'stragglers.delayed_workers': 2, 'stragglers.delay_s': 0.02}),
      ('fixed_groups', 2, 4, 5, 0.0, {'stragglers.kind': 'exponential', 'algorithm.fixed_groups': True}),
      ('no_stragglers', 8, 4, 3, 0.0, {}),
      # Worker 3 fails for good during iteration 7, after the global average of iteration 6 (the next, 13, is
      # beyond the run): from then on it is frozen and its groups average over their 3 live members.
      ('lost_worker_vmapped_momentum', 4, 4, 7, 0.9, {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.05,
                                                      'stragglers.fail_worker': 3, 'stragglers.fail_at_s': 0.075}),
  )
  def test_matches_sequential_reference(self, devices, group_size, tau, momentum, overrides):
    iterations, p = 12, 8
    with jax.enable_x64(True):
      config = _f64(f'wagma,group_size={group_size},sync_every={tau}', workers=p, devices=devices,
                    **{'optimizer.momentum': momentum, **overrides})
      traj = harness.run_iterations(config, iterations, block=4)
    fresh_all = np.stack([s.fresh for s in traj.schedules])
    globals_ = np.array([bool(s.global_average) for s in traj.schedules])
    np.testing.assert_array_equal(np.flatnonzero(globals_), np.arange(tau - 1, iterations, tau))
    if overrides:
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
      if globals_[t]:
        mean = [np.mean([m[k] for m in stepped], axis=0) for k in range(2)]
        models = [list(mean) for _ in range(p)]
      else:
        ids = wagma.group_ids(0 if fixed else t, p, group_size)
        np.testing.assert_array_equal(traj.schedules[t].group, ids)
        contribution = [stepped[i] if fresh[i] else buffers[i] for i in range(p)]
        new_models = []
        for i in range(p):
          if not live[i]:
            new_models.append(models[i])
            continue
          group = [j for j in np.flatnonzero(ids == ids[i]) if live[j]]
          self.assertEqual(traj.schedules[t].members[i], len(group))
          total = [sum(contribution[j][k] for j in group) for k in range(2)]
          new_models.append([total[k] / len(group) if fresh[i] else (total[k] + stepped[i][k]) / (len(group) + 1)
                             for k in range(2)])
        models = new_models
      buffers = [stepped[i] if live[i] else buffers[i] for i in range(p)]
      if (t + 1) % 4 == 0:  # params are recorded per block of 4
        for i in range(p):
          got_w, got_b = reference.unpack(traj.params[t // 4], i)
          np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
          np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)

  @parameterized.named_parameters(('group_size_p', 'group_size=8,sync_every=5'), ('tau_one', 'sync_every=1'))
  def test_global_average_every_iteration_is_local_sgd_h1(self, arg):
    stragglers = {'stragglers.kind': 'lognormal', 'stragglers.sigma': 0.3, 'stragglers.delayed_workers': 2,
                  'stragglers.delay_s': 0.02, 'optimizer.momentum': 0.9}
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(a, workers=8, devices=4, **stragglers), 6, block=3)
              for a in (f'wagma,{arg}', 'local_sgd,local_steps=1')]
    for a, b in zip(runs[0].params, runs[1].params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  def test_workers_on_fewer_devices_give_the_same_trajectory(self):
    stragglers = {'stragglers.kind': 'exponential', 'stragglers.delayed_workers': 2, 'stragglers.delay_s': 0.02}
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64('wagma,group_size=4,sync_every=5', workers=16, devices=d, **stragglers),
                                     10, block=5) for d in (8, 2, 1)]
    for other in runs[1:]:
      for a, b in zip(runs[0].params, other.params):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)


_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')


def _permute_masks(text: str) -> dict[str, set[int]]:
  """Computation name -> the XOR masks (source ^ target) of its collective-permutes."""
  out, current = {}, None
  for line in text.splitlines():
    match = hlo._COMPUTATION.match(line)  # pylint: disable=protected-access
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
    run = train.build(config)
    state = train.init_state(run)
    _, nbytes = train.param_count_and_bytes(state.params)
    block = train.make_clock(run, nbytes).next_block(4)
    inputs, _ = train.block_inputs(run, block, np.zeros(workers, np.int64), 0)
    text = train.make_block_step(run).lower(state, *inputs).compile().as_text()
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
    rule = wagma.time_rule(config)
    self.assertEqual((rule.group_size, rule.period), (4, 10))
    self.assertGreater(rule.activation_latency_s, 0)


if __name__ == '__main__':
  absltest.main()
