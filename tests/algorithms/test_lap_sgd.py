"""LAP-SGD / LPP-SGD: the NodeThreads time rule, a sequential float64 reference, Q = 1 d = 0 is local SGD.

The reference replays the schedule's events on least squares in a plain numpy loop: per node the model W, Q
thread views, Q momentum buffers, the learning rate of the node counter, the snapshot in flight and its
non-blocking average W + (mean(s) - s), LPP partial steps on the thread's block.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import lap_sgd
from waitless.cluster.rules import lap_sgd as lap_sgd_rule
from waitless.cluster.rules import local_sgd
from waitless.algorithms import optimizers
from waitless.cluster import clock as clock_lib
from waitless.cluster import network as network_lib
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import validation
from tests import harness
from tests import hlo
from tests.algorithms import reference
from tests.cluster import helpers

X = 0.01
P = 8


def every(h):
  return lambda t: (t + 1) % h == 0


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


@dataclasses.dataclass(frozen=True)
class _Ramp:
  """Micro-batch u of worker i takes (u + 1) ms x (i + 1): deterministic, distinct per unit."""

  def sample(self, rng, workers, units):
    del rng
    return 1e-3 * (np.asarray(units) + 1.0) * (np.asarray(workers) + 1.0)

  def mean(self):
    return 1e-3


def _ramp_clock(rule, workers=4):
  return clock_lib.Clock(workers=workers, rule=rule, compute=_Ramp(), network=network_lib.Ideal(),
                         model_bytes=1e6, seed=0)


class TimeRuleTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 4)
  def test_compute_is_drawn_per_unit_of_data_consumed(self, q):
    # Fix 1: 8 node updates of m = 2 micro-batches consume 16 micro-batches per node, and their time is
    # exactly the time of those 16 (today's rule drew Q*m per update and scaled it by 1/Q).
    m, n = 2, 8
    clock = _ramp_clock(lap_sgd_rule.NodeThreads(q, lambda t: False, microbatches=m))
    block = clock.next_block(n)
    np.testing.assert_array_equal(clock.units, n * m)
    want = 1e-3 * np.arange(1, n * m + 1).sum() * (np.arange(4) + 1.0)
    np.testing.assert_allclose(clock.times, want, rtol=1e-12)
    # Within a thread round the Q updates share the round's time evenly.
    first = 1e-3 * np.arange(1, q * m + 1).sum() / q
    np.testing.assert_allclose(block.sim_time[:q], first * 4 * np.arange(1, q + 1), rtol=1e-12)

  def test_more_threads_are_not_faster_on_the_same_data(self):
    # Fix 1, statistically: exponential micro-batches, blocking average every 16 updates. Today's rule gives
    # about 13.6, 11.8, 10.9 ms per update for Q = 1, 4, 16 (the spread of a node update shrinks with Q).
    per_update = {}
    for q in (1, 4, 16):
      rule = lap_sgd_rule.NodeThreads(q, every(16), delay_steps=0)
      block = helpers.clock(rule, workers=P, kind='exponential', rate=100.0).next_block(4000)
      per_update[q] = block.sim_time[-1] / 4000
    for q in (4, 16):
      self.assertAlmostEqual(per_update[q] / per_update[1], 1.0, delta=0.04, msg=str(per_update))

  def test_ideal_network_delays_the_average_by_one_update(self):
    # Fix 2: d = max(1, ceil(allreduce / update)); d = 0 only when asked for.
    clock = helpers.clock(lap_sgd_rule.NodeThreads(2, every(4)), workers=4, base_s=X)
    block = clock.next_block(12)
    self.assertEqual(clock.rule_state['delay_steps'], 1)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.snapshot), [3, 7, 11])
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), [4, 8])
    np.testing.assert_array_equal(block.schedule.average_age[[4, 8]], 1)
    explicit = helpers.clock(lap_sgd_rule.NodeThreads(2, every(4), delay_steps=0), workers=4, base_s=X).next_block(12)
    np.testing.assert_array_equal(np.flatnonzero(explicit.schedule.apply_average), [3, 7, 11])
    np.testing.assert_array_equal(explicit.schedule.average_age, 0)

  def test_a_faster_network_is_not_slower(self):
    kwargs = dict(workers=P, kind='lognormal', base_s=X, sigma=0.5)
    ideal = helpers.clock(lap_sgd_rule.NodeThreads(4, every(8)), **kwargs).next_block(200)
    slow = helpers.clock(lap_sgd_rule.NodeThreads(4, every(8)), network={'kind': 'alpha_beta', 'latency_s': 1e-3},
                         **kwargs).next_block(200)
    barrier = helpers.clock(lap_sgd_rule.NodeThreads(4, every(8), delay_steps=0), **kwargs).next_block(200)
    self.assertLess(ideal.sim_time[-1], slow.sim_time[-1])
    self.assertLess(ideal.sim_time[-1], barrier.sim_time[-1])  # d = 0 would wait for the last node

  def test_delay_from_network_and_hidden_averaging(self):
    network = {'kind': 'alpha_beta', 'latency_s': 0.0, 'bandwidth_gbps': 1.0}
    model_bytes = 2.5 * X / (2 * (P - 1) / P * 8e-9)  # all-reduce = 2.5 updates
    clock = helpers.clock(lap_sgd_rule.NodeThreads(4, every(16)), workers=P, base_s=X, network=network,
                          model_bytes=model_bytes)
    block = clock.next_block(64)
    self.assertEqual(clock.rule_state['delay_steps'], 3)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), [18, 34, 50])
    np.testing.assert_array_equal(block.schedule.thread[:8], [0, 1, 2, 3, 0, 1, 2, 3])
    np.testing.assert_allclose(block.duration, X, rtol=1e-9)

  @parameterized.parameters(1, 3)
  def test_reports_hogwild_staleness(self, q):
    # Fix 3: update t applies a gradient taken at the node model of update t - Q + 1.
    rule = lap_sgd_rule.NodeThreads(q, every(4))
    self.assertEqual(rule.reports, {'thread_staleness': 'mean'})
    block = helpers.clock(rule, workers=4, base_s=X).next_block(10)
    want = np.minimum(np.arange(10), q - 1)
    np.testing.assert_array_equal(block.mean_staleness, want)
    np.testing.assert_array_equal(block.measurements['thread_staleness'], want)

  def test_partial_steps_cost_partial_cost(self):
    # Fix 4: LPP partial steps (from prepass on, every other thread round) cost `partial_cost` of a full step.
    rule = lap_sgd_rule.NodeThreads(2, every(100), prepass_steps=3, partial_cost=0.25)
    block = helpers.clock(rule, workers=4, base_s=X).next_block(12)
    partial = np.zeros(12, bool)
    partial[[5, 6, 9, 10]] = True
    np.testing.assert_array_equal(block.schedule.partial, partial)
    np.testing.assert_allclose(block.duration, np.where(partial, 0.25 * X, X), rtol=1e-12)
    default = helpers.clock(lap_sgd_rule.NodeThreads(2, every(100), prepass_steps=3), workers=4, base_s=X)
    np.testing.assert_allclose(default.next_block(12).duration, X, rtol=1e-12)  # default 1.0: no saving
    self.assertFalse(
        helpers.clock(lap_sgd_rule.NodeThreads(2, every(4)), base_s=X).next_block(12).schedule.partial.any())

  def test_snapshot_before_previous_apply_forces_it(self):
    block = helpers.clock(lap_sgd_rule.NodeThreads(1, every(2), delay_steps=3), workers=4, base_s=X).next_block(8)
    np.testing.assert_array_equal(np.flatnonzero(block.schedule.apply_average), [3, 5, 7])
    np.testing.assert_array_equal(block.schedule.average_age[[3, 5, 7]], [2, 2, 2])

  def test_q1_d0_time_is_local_sgd(self):
    kwargs = dict(workers=P, kind='lognormal', base_s=X, sigma=0.5)
    lap = helpers.clock(lap_sgd_rule.NodeThreads(1, every(4), delay_steps=0), **kwargs).next_block(40)
    local = helpers.clock(local_sgd.PeriodicAverage(every(4)), **kwargs).next_block(40)
    np.testing.assert_allclose(lap.sim_time, local.sim_time, rtol=1e-12)

  def test_resume_is_exact_within_a_thread_round(self):
    make = lambda: helpers.clock(lap_sgd_rule.NodeThreads(4, every(8), prepass_steps=2, partial_cost=0.5),
                                 workers=4, kind='exponential', rate=100.0)
    whole = make()
    whole.next_block(6)
    want = whole.next_block(9)
    first = make()
    first.next_block(6)  # stops inside the second thread round
    resumed = make()
    resumed.load_state_dict(helpers.json_round_trip(first.state_dict()))
    helpers.assert_blocks_equal(self, resumed.next_block(9), want)

  def test_rule_errors(self):
    for kwargs, field in ((dict(threads=0), 'threads'), (dict(partial_cost=0.0), 'partial_cost'),
                          (dict(partial_cost=1.5), 'partial_cost'), (dict(delay_steps=-1), 'delay_steps'),
                          (dict(prepass_steps=-1), 'prepass_steps')):
      with self.assertRaisesRegex(ValueError, field):
        lap_sgd_rule.NodeThreads(**{'threads': 2, 'averages_at': every(4), **kwargs})


class BlockTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 3, 4, 7, 17)
  def test_blocks_are_disjoint_contiguous_and_cover_everything(self, q):
    tree = {'a': np.zeros((3, 4)), 'b': np.zeros(5), 'c': {'d': np.zeros(()), 'e': np.zeros((2, 2, 2))}}
    total = 12 + 5 + 1 + 8
    masks = [jax.tree.map(np.asarray, lap_sgd.block_masks(tree, j, q)) for j in range(q)]
    flat = np.stack([np.concatenate([m.ravel() for m in jax.tree.leaves(mask)]) for mask in masks])
    np.testing.assert_array_equal(flat.sum(axis=0), 1)  # disjoint and covering
    sizes = flat.sum(axis=1)
    self.assertLessEqual(sizes.max() - sizes.min(), 1)
    for row in flat:  # contiguous in leaf order
      where = np.flatnonzero(row)
      if len(where):
        np.testing.assert_array_equal(where, np.arange(where[0], where[-1] + 1))
    self.assertEqual(sizes.sum(), total)

  def test_partial_steps_alternate_after_the_prepass(self):
    got = [bool(lap_sgd.partial_at(t, 2, 3)) for t in range(12)]
    self.assertEqual(got, [False] * 5 + [True, True, False, False, True, True, False])
    self.assertFalse(any(bool(lap_sgd.partial_at(t, 2, None)) for t in range(12)))


class MathTest(parameterized.TestCase):

  def test_learning_rate_follows_the_node_counter(self):
    # Q = 4 threads, lr(t) = 0.1 (t + 1), one node, no averaging: update t must be -lr(t) x gradient,
    # not -lr(t // Q) as each thread's own optax counter would give.
    q, n = 4, 10
    tx = lap_sgd.lap_sgd(optax.sgd(lambda count: 0.1 * (count + 1)), threads=q, local_steps=1000, delay=1)
    params = {'w': jnp.zeros(3)}
    state = tx.init(params)
    for t in range(n):
      updates, state = tx.update({'w': jnp.ones(3)}, state, params)
      np.testing.assert_allclose(updates['w'], -0.1 * (t + 1), rtol=1e-6, err_msg=f'update {t}')
      params = optax.apply_updates(params, updates)

  def test_thread_views_and_momentum_are_per_thread(self):
    # Q = 2: update t's gradient is taken at the view of thread t mod 2, the node model after update t - 1.
    tx = lap_sgd.lap_sgd(optax.sgd(1.0, momentum=0.5), threads=2, local_steps=1000, delay=1)
    params = {'w': jnp.zeros(())}
    state = tx.init(params)
    seen, traces = [], []
    for t in range(5):
      schedule = lap_sgd.NodeThreadsSchedule(
          microbatches_done=None, snapshot=False, apply_average=False, average_age=0, thread=t % 2, partial=False)
      view = lap_sgd.thread_params(params, state, schedule, 0)
      seen.append(float(view['w']))
      updates, state = tx.update({'w': jnp.ones(())}, state, params, schedule=schedule)
      params = optax.apply_updates(params, updates)
      traces.append(float(params['w']))
    # momentum per thread: thread 0 steps 1, 1.5, 1.75; thread 1 steps 1, 1.5
    np.testing.assert_allclose(traces, [-1, -2, -3.5, -5, -6.75])
    np.testing.assert_allclose(seen, [0, 0, -1, -2, -3.5])


class ReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('lap_one_worker_per_device', 'lap_sgd,threads=3,local_steps=4,delay=2', 4, 0.9),
      ('lap_two_workers_per_device_network_delay', 'lap_sgd,threads=2,local_steps=3', 2, 0.5),
      ('lap_post_local', 'lap_sgd,threads=2,local_steps=4,pre_post_steps=3,delay=1', 2, 0.0),
      ('lpp_one_worker_per_device', 'lpp_sgd,threads=3,local_steps=4,delay=2,prepass_steps=2', 4, 0.9),
      ('lpp_two_workers_per_device', 'lpp_sgd,threads=4,local_steps=5,delay=3,prepass_steps=1', 2, 0.9),
  )
  def test_matches_sequential_reference(self, arg, devices, momentum):
    iterations, p = 14, 4
    with jax.enable_x64(True):
      config = _f64(arg, workers=p, devices=devices, **{
          # warmup 0, 1/64, 2/64, 3/64, then 1/16: exact in float32, so the float64 reference needs no rounding
          'optimizer.momentum': momentum, 'optimizer.learning_rate': 0.0625, 'optimizer.warmup_steps': 4,
          'stragglers.kind': 'exponential', 'stragglers.rate': 100.0})
      traj = harness.run_iterations(config, iterations, block=4)
      schedule = optimizers.learning_rate_schedule(config.optimizer, config.num_steps)
      rates = [float(schedule(t)) for t in range(iterations)]  # by the node counter t
    a = config.algorithm
    q, lpp = a.threads, a.name == 'lpp_sgd'
    s = [traj.schedules[t] for t in range(iterations)]
    np.testing.assert_array_equal([int(x.thread) for x in s], np.arange(iterations) % q)
    self.assertTrue(any(bool(x.apply_average) and int(x.average_age) > 0 for x in s), 'no delayed average')
    if lpp:
      self.assertTrue(any(bool(x.partial) for x in s), 'no partial step')
    dim = reference.unpack(traj.initial_params, 0)[0].shape[0]
    bounds = lap_sgd.block_bounds(dim + 1, q)  # leaf order: bias (1,), then kernel (d, 1)
    flat = lambda w, b: np.concatenate([[b], w])
    models = [flat(*reference.unpack(traj.initial_params, i)) for i in range(p)]
    views = [[m.copy() for _ in range(q)] for m in models]
    traces = [[np.zeros(dim + 1) for _ in range(q)] for _ in range(p)]
    snapshots = [None] * p
    for t in range(iterations):
      j, lr = t % q, rates[t]
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        v = views[i][j]
        gw, gb = reference.gradient(v[1:], v[0], batch['image'][0], batch['label'][0])
        g = flat(gw, gb)
        keep = np.ones(dim + 1, bool)
        if bool(s[t].partial):
          keep = (np.arange(dim + 1) >= bounds[j]) & (np.arange(dim + 1) < bounds[j + 1])
        traces[i][j] = np.where(keep, g + momentum * traces[i][j], traces[i][j])
        models[i] = models[i] - np.where(keep, lr * traces[i][j], 0.0)
      if bool(s[t].apply_average) and int(s[t].average_age) > 0:
        mean = np.mean(snapshots, axis=0)
        models = [models[i] + (mean - snapshots[i]) for i in range(p)]
      if bool(s[t].snapshot):
        snapshots = [m.copy() for m in models]
      if bool(s[t].apply_average) and int(s[t].average_age) == 0:
        models = [np.mean(models, axis=0)] * p
      for i in range(p):
        views[i][j] = models[i].copy()
      if (t + 1) % 4 == 0 or t == iterations - 1:  # params are recorded per block of 4
        for i in range(p):
          got = flat(*reference.unpack(traj.params[t // 4], i))
          np.testing.assert_allclose(got, models[i], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_one_thread_without_delay_is_local_sgd(self, devices):
    with jax.enable_x64(True):
      kwargs = dict(workers=4, devices=devices, **{'optimizer.momentum': 0.9, 'optimizer.warmup_steps': 3,
                                                    'stragglers.kind': 'exponential'})
      lap = harness.run_iterations(_f64('lap_sgd,threads=1,local_steps=3,delay=0', **kwargs), 9, block=3)
      local = harness.run_iterations(_f64('local_sgd,local_steps=3', **kwargs), 9, block=3)
    for a, b in zip(lap.params, local.params):
      jax.tree.map(np.testing.assert_array_equal, a, b)

  def test_average_is_a_conditional_with_vmapped_workers(self):
    config = harness.synthetic_config('lpp_sgd,threads=2,local_steps=2,delay=1', workers=4, devices=2,
                                      steps_per_call=4)
    run = setup.build(config)
    state = setup.init_state(run)
    _, nbytes = setup.param_count_and_bytes(state.params)
    block = setup.clock_for(run, nbytes).next_block(4)
    inputs, _ = inputs_lib.block_inputs(run, block, np.zeros(4, np.int64), 0)
    program = hlo.parse(block_step_lib.BlockStep(run).lower(state, *inputs).compile().as_text())
    self.assertEqual(program.collectives_outside_conditionals(), [])
    self.assertGreater(program.conditionals, 0)


class ConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('threads', 'lap_sgd,threads=0', 'algorithm.threads=0'),
      ('local_steps', 'lap_sgd,local_steps=0', 'algorithm.local_steps=0'),
      ('pre_post_steps', 'lap_sgd,pre_post_steps=-1', 'algorithm.pre_post_steps=-1'),
      ('negative_delay', 'lap_sgd,delay=-1', 'algorithm.delay=-1'),
      ('delay_above_local_steps', 'lap_sgd,local_steps=4,delay=5', 'algorithm.delay=5'),
      ('prepass_steps', 'lpp_sgd,prepass_steps=-2', 'algorithm.prepass_steps=-2'),
      ('partial_cost_zero', 'lpp_sgd,partial_cost=0.0', 'algorithm.partial_cost=0.0'),
      ('partial_cost_above_one', 'lpp_sgd,partial_cost=1.5', 'algorithm.partial_cost=1.5'),
  )
  def test_one_line_error_naming_the_field(self, arg, message):
    config = harness.synthetic_config(arg)
    with self.assertRaises(errors.ConfigError) as caught:
      validation.validate(config)
    self.assertTrue(str(caught.exception).startswith(message), str(caught.exception))
    self.assertNotIn('\n', str(caught.exception))

  def test_defaults(self):
    config = harness.synthetic_config('lpp_sgd')
    validation.validate(config)
    rule = lap_sgd_rule.time_rule(config)
    self.assertEqual((rule.threads, rule.delay_steps, rule.prepass_steps, rule.partial_cost), (4, None, 0, 1.0))
    self.assertIsNone(lap_sgd_rule.time_rule(harness.synthetic_config('lap_sgd')).prepass_steps)


if __name__ == '__main__':
  absltest.main()
