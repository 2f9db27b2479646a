"""Non-blocking SGD: sequential float64 references for random straggler schedules, sync and MultiSteps equivalence,
the data contract (unfinished micro-batches come first next round), the time rule's activation and reports,
config errors.

The harness runs least squares with exponential compute times (so workers finish 0..m micro-batches); the
reference replays the rule's finished counts in one numpy loop with its own data positions (0, then += n_i),
reading each worker's stream contiguously: if the harness skipped or repeated an abandoned micro-batch, the
parameters would disagree.
"""

import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import nonblocking
from waitless.cluster.rules import nonblocking as nonblocking_rule
from waitless.cluster.rules import wagma
from waitless.cluster.rules import activation as activation_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from tests import harness
from tests.algorithms import reference
from tests.cluster import helpers

X = 0.01


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{
      'model.param_dtype': 'float64', 'model.dtype': 'float64', 'stragglers.kind': 'exponential',
      'stragglers.rate': 100.0, **overrides})


def _microbatch_gradients(run, worker, position, count, model):
  """[(gw, gb)] of micro-batches position .. position+count-1 of `worker`, each the mean over its samples."""
  if count == 0:
    return []
  batch = harness.worker_batch(run, worker, position, count)
  return [reference.gradient(model[0], model[1], batch['image'][k], batch['label'][k]) for k in range(count)]


def mix(models, i):
  """(models[i-1] + models[i] + models[i+1]) / 3 over the distinct ring neighbours (P = 1, 2 special)."""
  p = len(models)
  members = sorted({(i - 1) % p, i, (i + 1) % p})
  return [sum(models[j][k] for j in members) / len(members) for k in range(2)]


def replay(test, traj, config, weighting, topology, block):
  """The sequential reference of `nonblocking` on traj's schedules; checks params at the end of every block
  (the harness records params once per block of `block` iterations)."""
  p, lr, momentum = config.workers, config.optimizer.learning_rate, config.optimizer.momentum
  models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
  opts = [reference.MomentumSGD(lr, momentum) for _ in range(p)]
  positions = np.zeros(p, np.int64)
  for t, schedule in enumerate(traj.schedules):
    done = schedule.microbatches_done.astype(np.int64)
    np.testing.assert_array_equal(traj.positions[t], positions, err_msg=f'data positions at iteration {t}')
    sums = []
    for i in range(p):
      grads = _microbatch_gradients(traj.run, i, int(positions[i]), int(done[i]), models[i])
      sums.append([sum((g[k] for g in grads), np.zeros_like(models[i][k]) if k == 0 else 0.0) for k in range(2)])
    if topology == 'allreduce':
      if weighting == 'microbatch':  # g = sum_i G_i / sum_i n_i
        g = [sum(s[k] for s in sums) / done.sum() for k in range(2)]
      else:  # mean over workers with n_i > 0 of G_i / n_i
        finished = np.flatnonzero(done)
        g = [sum(sums[i][k] / done[i] for i in finished) / len(finished) for k in range(2)]
      for i in range(p):
        models[i] = opts[i].step(models[i], g)
    else:
      for i in range(p):
        if done[i]:
          models[i] = opts[i].step(models[i], [sums[i][k] / done[i] for k in range(2)])
      models = [mix(models, i) for i in range(p)]
    positions = positions + done  # unfinished micro-batches are not consumed: they come first next round
    if (t + 1) % block:
      continue
    reference.assert_workers_match(traj.params[t // block], models, f'iteration {t}')


class NonBlockingMathTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('microbatch', 'microbatch', 'allreduce', 4, {}),
      ('worker', 'worker', 'allreduce', 4, {}),
      ('microbatch_momentum_vmapped', 'microbatch', 'allreduce', 4, {'optimizer.momentum': 0.9, 'devices': 2}),
      ('worker_momentum_vmapped', 'worker', 'allreduce', 4, {'optimizer.momentum': 0.9, 'devices': 2}),
      ('m1_is_sync_of_the_finishers', 'microbatch', 'allreduce', 1, {}),
      ('deadline', 'microbatch', 'allreduce', 4, {'trigger': 'deadline', 'deadline_s': 0.025}),
      ('ring', 'microbatch', 'ring', 4, {'optimizer.momentum': 0.9}),
      ('ring_eight_on_two_devices', 'worker', 'ring', 2, {'workers': 8, 'devices': 2}),
      ('ring_two_workers', 'microbatch', 'ring', 2, {'workers': 2, 'devices': 2}),
  )
  def test_matches_sequential_reference(self, weighting, topology, m, overrides):
    overrides = dict(overrides)
    algorithm = {k: overrides.pop(k) for k in ('trigger', 'deadline_s') if k in overrides}
    arg = f'nonblocking,weighting={weighting},topology={topology}' + ''.join(
        f',{k}={v}' for k, v in algorithm.items())
    with jax.enable_x64(True):
      config = _f64(arg, microbatches=m, **overrides)
      traj = harness.run_iterations(config, 12, block=3)
    done = np.stack([s.microbatches_done for s in traj.schedules])
    if m > 1:
      self.assertTrue(np.any((done > 0) & (done < m)), 'no partial contribution: the test would be weak')
    self.assertTrue(np.any(done == 0) or m > 2, 'no worker without a contribution')
    replay(self, traj, config, weighting, topology, block=3)

  def test_no_stragglers_equals_sync_with_batch_b(self):
    with jax.enable_x64(True):
      base = {'model.param_dtype': 'float64', 'model.dtype': 'float64', 'optimizer.momentum': 0.9}
      sync = harness.run_iterations(harness.synthetic_config('sync', microbatches=1, **base), 6, block=3)
      for weighting in ('microbatch', 'worker'):
        for m, devices in ((2, 4), (4, 2)):
          config = harness.synthetic_config(f'nonblocking,weighting={weighting}', microbatches=m, devices=devices,
                                            **base)
          nb = harness.run_iterations(config, 6, block=3)
          np.testing.assert_array_equal(np.stack([s.microbatches_done for s in nb.schedules]), m)
          for a, b in zip(nb.params, sync.params):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  def test_no_stragglers_equals_optax_multisteps(self):
    m, iterations = 4, 5
    with jax.enable_x64(True):
      config = harness.synthetic_config('nonblocking', microbatches=m, **{
          'model.param_dtype': 'float64', 'model.dtype': 'float64', 'optimizer.momentum': 0.9})
      traj = harness.run_iterations(config, iterations, block=iterations)
      w, b = reference.unpack(traj.initial_params)
      params = {'w': jnp.asarray(w), 'b': jnp.asarray(b)}
      # accumulator_dtype: MultiSteps accumulates in float32 unless told.
      tx = optax.MultiSteps(optax.sgd(config.optimizer.learning_rate, momentum=0.9), every_k_schedule=m,
                            accumulator_dtype=jnp.float64)
      state = tx.init(params)
      for t in range(iterations):
        for k in range(m):  # one MultiSteps call per micro-batch, on the workers' mean micro-batch gradient
          model = (np.asarray(params['w']), float(params['b']))
          grads = [_microbatch_gradients(traj.run, i, t * m + k, 1, model)[0] for i in range(config.workers)]
          g = {'w': jnp.mean(jnp.stack([jnp.asarray(x[0]) for x in grads]), 0),
               'b': jnp.mean(jnp.asarray([x[1] for x in grads]))}
          updates, state = tx.update(g, state, params)
          params = optax.apply_updates(params, updates)
    for i in range(config.workers):
      got_w, got_b = reference.unpack(traj.params[-1], i)
      np.testing.assert_allclose(got_w, params['w'], rtol=1e-11, atol=1e-13)
      np.testing.assert_allclose(got_b, float(params['b']), rtol=1e-11, atol=1e-13)

  def test_unfinished_microbatches_come_first_next_round(self):
    config = harness.synthetic_config('nonblocking', microbatches=4, **{'stragglers.kind': 'exponential'})
    traj = harness.run_iterations(config, 8, block=4)
    seen = 0
    for t in range(7):
      done = traj.schedules[t].microbatches_done
      np.testing.assert_array_equal(traj.positions[t + 1], traj.positions[t] + done)
      for i in np.flatnonzero(done < 4):
        seen += 1
        # Next round, worker i starts with the micro-batch it abandoned: the first of this round's batch it did
        # not finish, read again from the same stream position.
        now = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 4)
        then = harness.worker_batch(traj.run, i, int(traj.positions[t + 1][i]), 1)
        np.testing.assert_array_equal(then['image'][0], now['image'][done[i]])
    self.assertGreater(seen, 0)

  def test_one_worker_library_use_is_the_inner_optimizer(self):
    params = {'w': jnp.array([1.0, -2.0])}
    grads = {'w': jnp.array([0.5, 0.25])}
    inner = optax.sgd(0.1, momentum=0.9)
    for topology in nonblocking.TOPOLOGIES:
      tx = nonblocking.nonblocking_sgd(inner, topology=topology)
      got, _ = tx.update(grads, tx.init(params), params)
      want, _ = inner.update(grads, inner.init(params), params)
      # The ring returns (W + u) - W: exact up to float32 rounding.
      np.testing.assert_allclose(got['w'], want['w'], rtol=1e-5)


def _fastest_first(rule, workers, first, **kwargs):
  """A clock on which worker `first` runs at X per micro-batch and every other worker 2x slower."""
  others = tuple(i for i in range(workers) if i != first)
  return helpers.clock(rule, workers=workers, base_s=X, slow_workers=others, slow_factor=2.0, **kwargs)


class NonBlockingRuleTest(parameterized.TestCase):

  @parameterized.parameters(('fastest', -1), ('deadline', -1), ('fastest', 2))
  def test_host_totals_are_the_divisors(self, trigger, fail_worker):
    config = harness.synthetic_config('nonblocking', microbatches=4, **{
        'algorithm.trigger': trigger, 'algorithm.deadline_s': 0.02, 'stragglers.kind': 'exponential',
        'stragglers.fail_worker': fail_worker, 'stragglers.fail_at_s': 0.05})
    run = setup.build(config)
    schedule = setup.clock_for(run, 1e3).next_block(40).schedule
    np.testing.assert_array_equal(schedule.microbatches_total, schedule.microbatches_done.sum(axis=1))
    np.testing.assert_array_equal(schedule.contributors, (schedule.microbatches_done > 0).sum(axis=1))
    self.assertTrue((schedule.microbatches_done < 4).any())  # partial rounds: the totals are not constant

  def test_reports_microbatches_and_abandoned_share(self):
    a = nonblocking_rule.NonBlocking(3).activation_latency_s
    clock = helpers.clock(nonblocking_rule.NonBlocking(3), workers=4, base_s=X, slow_workers=(0,), slow_factor=2.5)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [1, 3, 3, 3])
    self.assertEqual(block.measurements['microbatches_mean'][0], 2.5)
    self.assertEqual(block.measurements['microbatches_min'][0], 1.0)
    # Worker 0 learns of the trigger (3X) one hop later; it spent 3X + a and lost 0.5X + a (its second
    # micro-batch, begun at 2.5X); all spent 12X + a.
    np.testing.assert_allclose(block.measurements['abandoned_share'][0], (0.5 * X + a) / (12 * X + a), rtol=1e-12)

  def test_default_activation_latency_is_wagmas_and_not_free(self):
    wagmas = wagma.WaitAvoidingGroups(2, 10).activation_latency_s
    self.assertEqual(nonblocking_rule.NonBlocking().activation_latency_s, wagmas)
    self.assertGreater(nonblocking_rule.NonBlocking().activation_latency_s, 0)
    config = harness.synthetic_config('nonblocking')
    validation.validate(config)
    self.assertEqual(nonblocking_rule.time_rule(config).activation_latency_s, wagmas)
    config = harness.synthetic_config('nonblocking,activation_latency_s=0.002')
    validation.validate(config)
    self.assertEqual(nonblocking_rule.time_rule(config).activation_latency_s, 0.002)

  @parameterized.named_parameters(
      ('p4', 4, 0, 2), ('p8', 8, 5, 3), ('p16', 16, 9, 4),
      # P not a power of two: the farthest worker from 0 among 0..5 is 2 hops away, from 2 (010 -> 101) 3.
      ('p6_from_0', 6, 0, 2), ('p6_from_2', 6, 2, 3), ('p1', 1, 0, 0))
  def test_ideal_network_trigger_costs_the_farthest_workers_hops(self, workers, first, hops):
    # Ideal network (free all-reduce): the round ends when the news of the first finisher's "I am done" has
    # reached the farthest worker, ceil(log2 P) hops of a for a power of two.
    a = 1e-3
    clock = _fastest_first(nonblocking_rule.NonBlocking(2, activation_latency_s=a), workers, first)
    block = clock.next_block(3)
    self.assertEqual(clock.network.allreduce(clock.model_bytes, workers), 0.0)
    np.testing.assert_allclose(block.duration, 2 * X + hops * a, rtol=1e-12)
    if workers & (workers - 1) == 0:
      self.assertEqual(hops, int(np.ceil(np.log2(workers))))
    # The finisher waits for the farthest worker to join; the farthest worker does not wait.
    np.testing.assert_allclose(block.idle[:, first], hops * a, rtol=1e-12)
    distance = np.array([bin(i ^ first).count('1') for i in range(workers)])
    np.testing.assert_allclose(block.idle[:, distance == hops], 0.0, atol=1e-15)
    # Everybody else finished one micro-batch (at 2X) before the news arrived: 1 each.
    want = [[2 if i == first else 1 for i in range(workers)]] * 3
    np.testing.assert_array_equal(block.schedule.microbatches_done, want)

  def test_worker_nearer_the_finisher_contributes_by_its_earlier_activation(self):
    # Worker 0 finishes its 4 micro-batches at 4X = 0.04; the others' end at 0.011 k. The news reaches the
    # 1-hop workers 1, 2, 4 at 0.043 (before their 4th: 3 each); workers 3, 5, 6 (2 hops, 0.046) and 7 (3
    # hops, 0.049) finish all 4 at 0.044 first and stop there. The communication starts at max_i A_i = 0.044.
    # (The old uniform activation, 4X + 3 a for everyone, would have let all of them finish 4.)
    a = 3e-3
    clock = helpers.clock(nonblocking_rule.NonBlocking(4, activation_latency_s=a), workers=8, base_s=X,
                          slow_workers=tuple(range(1, 8)), slow_factor=1.1)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [4, 3, 3, 4, 3, 4, 4, 4])
    np.testing.assert_allclose(block.duration, 4 * 1.1 * X, rtol=1e-12)
    # Idle: the finisher from 0.04, the 1-hop workers from 0.043 (after abandoning their 4th), the others none.
    np.testing.assert_allclose(block.idle[0], [0.4 * X, 0.1 * X, 0.1 * X, 0, 0.1 * X, 0, 0, 0], atol=1e-15)
    # Workers 1, 2, 4 abandoned their 4th micro-batch: started (the trace moves on), not consumed.
    np.testing.assert_array_equal(clock.units, [4] * 8)
    np.testing.assert_array_equal(block.schedule.abandoned[0], [False, True, True, False, True, False, False, False])
    free = helpers.clock(nonblocking_rule.NonBlocking(4, activation_latency_s=0.0), workers=8, base_s=X,
                         slow_workers=tuple(range(1, 8)), slow_factor=1.1).next_block(1)
    np.testing.assert_array_equal(free.schedule.microbatches_done[0], [4, 3, 3, 3, 3, 3, 3, 3])
    np.testing.assert_allclose(free.duration, 4 * X, rtol=1e-12)

  def test_deadline_at_the_budget_needs_no_message(self):
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}
    rule = nonblocking_rule.NonBlocking(3, trigger='deadline', deadline_s=0.015, activation_latency_s=1e-3)
    clock = helpers.clock(rule, workers=4, base_s=X, slow_workers=(0,), slow_factor=2.0, network=net)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [0, 1, 1, 1])
    np.testing.assert_allclose(block.duration, 0.015 + clock.network.allreduce(clock.model_bytes, 4))

  def test_deadline_everyone_done_early_needs_no_message(self):
    # Everyone finishes all 3 before the budget: the all-reduce starts when the last (worker 0, 6X) joins.
    rule = nonblocking_rule.NonBlocking(3, trigger='deadline', deadline_s=1.0, activation_latency_s=1e-3)
    block = helpers.clock(rule, workers=4, base_s=X, slow_workers=(0,), slow_factor=2.0).next_block(2)
    np.testing.assert_array_equal(block.schedule.microbatches_done, 3)
    np.testing.assert_allclose(block.duration, 6 * X, rtol=1e-12)
    np.testing.assert_allclose(block.idle, [[0, 3 * X, 3 * X, 3 * X]] * 2, rtol=1e-12)

  def test_deadline_with_nothing_done_waits_for_the_first_ones_news(self):
    # Nobody has a micro-batch by the budget: worker 0 finishes one at X and its news takes popcount(i) hops.
    a = 1e-3
    rule = nonblocking_rule.NonBlocking(2, trigger='deadline', deadline_s=1e-4, activation_latency_s=a)
    block = _fastest_first(rule, 8, 0).next_block(2)
    np.testing.assert_array_equal(block.schedule.microbatches_done, [[1, 0, 0, 0, 0, 0, 0, 0]] * 2)
    np.testing.assert_allclose(block.duration, X + 3 * a, rtol=1e-12)

  @parameterized.named_parameters(
      # One first arrival per round (the eccentricity lookup) or near-ties (the round's relaxation), P = 6, 12.
      ('exponential_p6', 6, {'kind': 'exponential', 'rate': 100.0}, {}, False),
      ('near_ties_p12', 12, {'kind': 'lognormal', 'sigma': 1e-4}, {}, True),
      # About half the rounds end at the budget, half on the first micro-batch's news.
      ('deadline_p12', 12, {'kind': 'exponential', 'rate': 100.0}, {'trigger': 'deadline', 'deadline_s': 5e-4},
       False),
      ('ring_near_ties_p6', 6, {'kind': 'lognormal', 'sigma': 1e-4}, {'topology': 'ring'}, True))
  def test_vectorised_rounds_equal_iterate_for_any_p(self, workers, stragglers, options, relaxes):
    make = lambda: helpers.clock(nonblocking_rule.NonBlocking(4, **options), workers=workers, model_bytes=4e6, seed=3,
                                 network={'kind': 'alpha_beta'}, base_s=X, **stragglers)
    loop, fast = make(), make()
    blocks = (50, 1, 29)
    for n in blocks:
      want = loop._block(n)
      with mock.patch.object(activation_lib, 'activation_times', wraps=activation_lib.activation_times) as relax:
        got = fast.next_block(n)
      helpers.assert_blocks_equal(self, want, got)
      # Once after the loop for the whole block, plus once per round that needs the relaxation (exponential
      # times: rarely a second arrival within 3 hops of the first).
      self.assertBetween(relax.call_count - 1, n // 2 if relaxes else 0, n if relaxes else max(n // 20, 1))
    np.testing.assert_array_equal(loop.times, fast.times)
    np.testing.assert_array_equal(loop.units, fast.units)
    if 'deadline_s' in options:
      late = fast.next_block(100).duration > options['deadline_s'] + fast.network.allreduce(4e6, workers)
      self.assertBetween(int(late.sum()), 20, 80)  # rounds that waited for the first micro-batch's news


class ConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('m_not_dividing_batch', 'nonblocking,microbatches=3',
       r'^microbatches=3 is not allowed: must divide batch_size=8$'),
      ('deadline_zero', 'nonblocking,trigger=deadline', r'^algorithm.deadline_s=0.0 is not allowed: must be > 0'),
      ('deadline_negative', 'nonblocking,trigger=deadline,deadline_s=-1',
       r'^algorithm.deadline_s=-1.0 is not allowed: must be > 0'),
      ('deadline_negative_unused', 'nonblocking,deadline_s=-0.5', r'^algorithm.deadline_s=-0.5 is not allowed'),
      ('trigger', 'nonblocking,trigger=slowest', r"^algorithm.trigger='slowest' is not allowed: must be one of "
       r'fastest, deadline$'),
      ('topology', 'nonblocking,topology=torus', r"^algorithm.topology='torus' is not allowed: must be one of "
       r'allreduce, ring$'),
      ('weighting', 'nonblocking,weighting=sample', r"^algorithm.weighting='sample' is not allowed"),
      ('activation_latency_negative', 'nonblocking,activation_latency_s=-1e-06',
       r'^algorithm.activation_latency_s=-1e-06 is not allowed: must be a number >= 0 \(seconds\)$'),
      ('order', 'dpsgd,order=step_then_gossip', r"^algorithm.order='step_then_gossip' is not allowed: must be one "
       r'of gossip_then_step, overlap$'),
  )
  def test_rejects_in_one_line(self, arg, message):
    with self.assertRaisesRegex(errors.ConfigError, message) as caught:
      validation.validate(harness.synthetic_config(arg))
    self.assertNotIn('\n', str(caught.exception))

  def test_rejects_nan_activation_latency(self):
    config = harness.synthetic_config('nonblocking', **{'algorithm.activation_latency_s': float('nan')})
    with self.assertRaisesRegex(errors.ConfigError, r'^algorithm.activation_latency_s=nan is not allowed: must be a '
                                r'number >= 0 \(seconds\)$'):
      validation.validate(config)
    with self.assertRaisesRegex(ValueError, 'activation_latency_s'):
      nonblocking_rule.NonBlocking(2, activation_latency_s=float('nan'))

  def test_defaults_are_valid(self):
    for arg in ('nonblocking', 'nonblocking,trigger=deadline,deadline_s=0.05', 'nonblocking,topology=ring',
                'dpsgd', 'dpsgd,order=overlap'):
      validation.validate(harness.synthetic_config(arg))

  def test_command_line_error_is_one_line(self):
    out = subprocess.run(
        [sys.executable, '-m', 'waitless.experiments.main',
         '--config=experiments/configs/digits.py:nonblocking,trigger=soon',
         '--workdir=/nonexistent/never_created'], capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(out.returncode, 2, out.stderr)
    self.assertIn("error: algorithm.trigger='soon' is not allowed: must be one of fastest, deadline", out.stderr)
    self.assertNotIn('Traceback', out.stderr)


class LoggingTest(absltest.TestCase):

  def test_training_loop_logs_microbatches_and_abandoned_share(self):
    config = harness.synthetic_config('nonblocking', microbatches=4, num_steps=20, log_every=10, eval_every=20,
                                      steps_per_call=10, **{'stragglers.kind': 'exponential'})
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(config, workdir)
      rows = metrics_io.read_rows(workdir)
      self.assertTrue(os.path.exists(os.path.join(workdir, 'summary.json')))
    self.assertLen(rows, 2)
    for row in rows:
      self.assertLessEqual(row['microbatches_min'], row['microbatches_mean'])
      self.assertGreater(row['microbatches_mean'], 0.0)
      self.assertLessEqual(row['microbatches_mean'], 4.0)
      self.assertGreater(row['abandoned_share'], 0.0)
      self.assertLess(row['abandoned_share'], 1.0)


if __name__ == '__main__':
  absltest.main()
