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

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import config_errors as errors
from algorithms import nonblocking
from experiments import metrics_io
from experiments import train
from experiments import validation
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
    for i in range(p):
      got_w, got_b = reference.unpack(traj.params[t // block], i)
      np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'iteration {t} worker {i}')
      np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)


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


class NonBlockingRuleTest(absltest.TestCase):

  def test_reports_microbatches_and_abandoned_share(self):
    clock = helpers.clock(nonblocking.NonBlocking(3), workers=4, base_s=X, slow_workers=(0,), slow_factor=2.5)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [1, 3, 3, 3])
    self.assertEqual(block.measurements['microbatches_mean'][0], 2.5)
    self.assertEqual(block.measurements['microbatches_min'][0], 1.0)
    # Worker 0 spent 3X and lost the last 0.5X (its second micro-batch, begun at 2.5X); all spent 12X.
    np.testing.assert_allclose(block.measurements['abandoned_share'][0], 0.5 / 12)

  def test_activation_costs_log2_p_latencies(self):
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}
    for p in (4, 8, 6):
      clock = helpers.clock(nonblocking.NonBlocking(2), workers=p, base_s=X, network=net)
      block = clock.next_block(3)
      hops = int(np.ceil(np.log2(p)))
      np.testing.assert_allclose(block.duration, 2 * X + hops * 1e-3 + clock.network.allreduce(clock.model_bytes, p),
                                 rtol=1e-12)

  def test_activation_lets_slower_workers_finish_more(self):
    # Worker 1 finishes its 2nd micro-batch 0.5 ms after the trigger: within the 2 ms activation, it counts.
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}
    slow = helpers.clock(nonblocking.NonBlocking(2), workers=4, base_s=X, slow_workers=(1,), slow_factor=1.025,
                         network=net).next_block(1)
    np.testing.assert_array_equal(slow.schedule.microbatches_done[0], [2, 2, 2, 2])
    free = helpers.clock(nonblocking.NonBlocking(2), workers=4, base_s=X, slow_workers=(1,),
                         slow_factor=1.025).next_block(1)
    np.testing.assert_array_equal(free.schedule.microbatches_done[0], [2, 1, 2, 2])

  def test_deadline_at_the_budget_needs_no_message(self):
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}
    clock = helpers.clock(nonblocking.NonBlocking(3, trigger='deadline', deadline_s=0.015), workers=4, base_s=X,
                          slow_workers=(0,), slow_factor=2.0, network=net)
    block = clock.next_block(1)
    np.testing.assert_array_equal(block.schedule.microbatches_done[0], [0, 1, 1, 1])
    np.testing.assert_allclose(block.duration, 0.015 + clock.network.allreduce(clock.model_bytes, 4))


class ConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('m_not_dividing_batch', 'nonblocking,microbatches=3', r'^microbatches=3 is not allowed: must divide batch_size=8$'),
      ('deadline_zero', 'nonblocking,trigger=deadline', r'^algorithm.deadline_s=0.0 is not allowed: must be > 0'),
      ('deadline_negative', 'nonblocking,trigger=deadline,deadline_s=-1',
       r'^algorithm.deadline_s=-1.0 is not allowed: must be > 0'),
      ('deadline_negative_unused', 'nonblocking,deadline_s=-0.5', r'^algorithm.deadline_s=-0.5 is not allowed'),
      ('trigger', 'nonblocking,trigger=slowest', r"^algorithm.trigger='slowest' is not allowed: must be one of "
       r'fastest, deadline$'),
      ('topology', 'nonblocking,topology=torus', r"^algorithm.topology='torus' is not allowed: must be one of "
       r'allreduce, ring$'),
      ('weighting', 'nonblocking,weighting=sample', r"^algorithm.weighting='sample' is not allowed"),
      ('order', 'dpsgd,order=step_then_gossip', r"^algorithm.order='step_then_gossip' is not allowed: must be one "
       r'of gossip_then_step, overlap$'),
  )
  def test_rejects_in_one_line(self, arg, message):
    with self.assertRaisesRegex(errors.ConfigError, message) as caught:
      validation.validate(harness.synthetic_config(arg))
    self.assertNotIn('\n', str(caught.exception))

  def test_defaults_are_valid(self):
    for arg in ('nonblocking', 'nonblocking,trigger=deadline,deadline_s=0.05', 'nonblocking,topology=ring',
                'dpsgd', 'dpsgd,order=overlap'):
      validation.validate(harness.synthetic_config(arg))

  def test_command_line_error_is_one_line(self):
    out = subprocess.run(
        [sys.executable, '-m', 'experiments.main', '--config=experiments/configs/digits.py:nonblocking,trigger=soon',
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
