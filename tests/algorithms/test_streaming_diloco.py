"""Streaming DiLoCo: sequential float64 reference, F = 1, d = 0, alpha = 0 is DiLoCo, whole rounds equal the
per-iteration path, fragments, the time rule (one fragment's all-reduce per sync, hidden under d steps), errors.

The reference keeps each worker's model as one float64 vector in leaf order (the linear model's leaves are
`bias` (1,) then `kernel` (16, 1)): fragment f is elements [f * 17 // F, (f + 1) * 17 // F).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

import config_errors as errors
from algorithms import local_sgd
from algorithms import streaming_diloco as sd
from cluster import network as network_lib
from experiments import validation
from tests import harness
from tests.algorithms import reference
from tests.algorithms import test_diloco
from tests.cluster import helpers

X = 0.01


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


def _flat(params, worker):
  w, b = reference.unpack(params, worker)
  return np.concatenate(([b], w))


class FragmentTest(parameterized.TestCase):

  def test_sync_table_staggers_the_fragments(self):
    np.testing.assert_array_equal(sd.sync_table(4, 1), [-1, -1, -1, 0])
    np.testing.assert_array_equal(sd.sync_table(4, 2), [-1, 0, -1, 1])
    np.testing.assert_array_equal(sd.sync_table(6, 4), [0, -1, 1, 2, -1, 3])
    np.testing.assert_array_equal(sd.sync_table(3, 3), [0, 1, 2])
    with self.assertRaisesRegex(ValueError, 'fragments'):
      sd.sync_table(2, 3)

  def test_pieces_cover_the_leaves_in_order_in_equal_parts(self):
    sizes = [3, 10, 1, 6]
    for f in range(1, 21):
      pieces = sd.fragment_pieces(sizes, f)
      lengths = [sum(b - a for _, a, b in p) for p in pieces]
      self.assertEqual(sum(lengths), 20)
      self.assertLessEqual(max(lengths) - min(lengths), 1)
      flat = [(k, j) for p in pieces for k, a, b in p for j in range(a, b)]
      self.assertEqual(flat, [(k, j) for k, n in enumerate(sizes) for j in range(n)])
    self.assertEqual(sd.fragment_pieces(sizes, 2), [[(0, 0, 3), (1, 0, 7)], [(1, 7, 10), (2, 0, 1), (3, 0, 6)]])
    with self.assertRaisesRegex(ValueError, 'empty'):
      sd.fragment_pieces(sizes, 21)

  def test_gather_scatter_round_trip(self):
    leaves = [np.arange(3.0), np.arange(10.0).reshape(2, 5) + 10]
    pieces = sd.fragment_pieces([3, 10], 3)[1]  # elements 4..8: leaf 1, flat 1..5
    np.testing.assert_array_equal(sd.gather(leaves, pieces), [11, 12, 13, 14])
    out = sd.scatter(leaves, pieces, -np.arange(4.0))
    np.testing.assert_array_equal(out[1].ravel(), [10, 0, -1, -2, -3, 15, 16, 17, 18, 19])
    np.testing.assert_array_equal(out[0], leaves[0])


class StreamingDiLoCoTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('f2_d1', 4, 2, 1, 0.5, 0.9, 4),
      ('f3_d2_two_workers_per_device', 6, 3, 2, 0.3, 0.0, 2),
      ('delay_equals_period', 3, 3, 3, 0.5, 0.9, 4),
      ('blocking', 4, 2, 0, 0.25, 0.9, 2),
      ('one_fragment_delayed', 3, 1, 2, 0.0, 0.5, 4))
  def test_matches_sequential_reference(self, local_steps, fragments, delay, mix, momentum, devices):
    iterations = 14
    arg = f'streaming_diloco,local_steps={local_steps},fragments={fragments},delay={delay},mix={mix}'
    with jax.enable_x64(True):
      config = _f64(arg, **{'optimizer.momentum': momentum, 'devices': devices})
      traj = harness.run_iterations(config, iterations)
    a, p = config.algorithm, config.workers
    models = [_flat(traj.initial_params, i) for i in range(p)]
    outer_model = models[0].copy()
    bounds = [(f * 17 // fragments, (f + 1) * 17 // fragments) for f in range(fragments)]
    syncs_at = {(f + 1) * local_steps // fragments - 1: f for f in range(fragments)}
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]
    outer = [test_diloco.OuterSGD(a.outer_learning_rate, a.outer_momentum, a.outer_nesterov)
             for _ in range(fragments)]
    pending = {}  # fragment -> (merge step, mean of the snapshots)

    def merge(f, mean):
      lo, hi = bounds[f]
      outer_model[lo:hi] = outer[f].step([outer_model[lo:hi]], [outer_model[lo:hi] - mean])[0]
      for m in models:
        m[lo:hi] = mix * m[lo:hi] + (1 - mix) * outer_model[lo:hi]

    for t in range(iterations):
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        w, b = models[i][1:], models[i][0]
        gw, gb = reference.gradient(w, b, batch['image'][0], batch['label'][0])
        new_w, new_b = opts[i].step([w, np.float64(b)], [gw, np.float64(gb)])
        models[i] = np.concatenate(([new_b], new_w))
      for f, (due, mean) in list(pending.items()):
        if due == t:
          merge(f, mean)
          del pending[f]
      if t % local_steps in syncs_at:
        f = syncs_at[t % local_steps]
        lo, hi = bounds[f]
        mean = np.mean([m[lo:hi] for m in models], axis=0)
        if delay == 0:
          merge(f, mean)
        else:
          pending[f] = (t + delay, mean)
      for i in range(p):
        np.testing.assert_allclose(_flat(traj.params[t], i), models[i], rtol=1e-10, atol=1e-12,
                                   err_msg=f'step {t} worker {i}')

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_one_fragment_no_delay_no_mix_is_diloco(self, devices):
    overrides = {'optimizer.momentum': 0.9, 'devices': devices}
    with jax.enable_x64(True):
      streaming = _f64('streaming_diloco,local_steps=3,fragments=1,delay=0,mix=0.0', **overrides)
      plain = _f64('diloco,local_steps=3', **overrides)
      runs = {(c.algorithm.name, block): harness.run_iterations(c, 9, block=block)
              for c in (streaming, plain) for block in (1, 3)}
    plain_run = runs['diloco', 1]
    moved = plain_run.params[-1]['Dense_0']['kernel'] - plain_run.initial_params['Dense_0']['kernel']
    self.assertGreater(np.abs(moved).max(), 1e-3)
    for block in (1, 3):
      for a, b in zip(runs['streaming_diloco', block].params, runs['diloco', block].params):
        test_diloco.assert_trees_close(a, b)

  @parameterized.named_parameters(
      ('d1_one_worker_per_device', 1, 4), ('d1_two_workers_per_device', 1, 2), ('d3_wrapping', 3, 4),
      ('d0', 0, 2), ('d4', 4, 4))
  def test_whole_round_blocks_equal_the_per_iteration_path(self, delay, devices):
    # block=8 with H=4: whole rounds (static positions, all-reduces issued outside conditionals, the first
    # round's carried merges masked); block=3: unaligned blocks on the per-iteration path; block=1.
    with jax.enable_x64(True):
      config = _f64(f'streaming_diloco,local_steps=4,fragments=2,delay={delay}',
                    **{'optimizer.momentum': 0.9, 'devices': devices})
      runs = {block: harness.run_iterations(config, 16, block=block) for block in (1, 3, 8)}
    self.assertEqual(runs[8].run.round_length, 4)
    self.assertEqual(runs[8].block_step.rounds._cache_size(), 1)  # pylint: disable=protected-access
    for block in (3, 8):
      test_diloco.assert_trees_close(runs[block].params[-1], runs[1].params[-1], rtol=1e-12, atol=1e-14)
    self.assertGreater(np.abs(runs[1].params[-1]['Dense_0']['kernel'][0]
                              - runs[1].params[-1]['Dense_0']['kernel'][1]).max(), 1e-6)  # not all averaged

  @parameterized.named_parameters(
      ('fragments_above_period', 'local_steps=2,fragments=3', 'algorithm.fragments'),
      ('zero_fragments', 'fragments=0', 'algorithm.fragments'),
      ('delay_above_period', 'local_steps=2,fragments=1,delay=3', 'algorithm.delay'),
      ('negative_delay', 'delay=-1', 'algorithm.delay'),
      ('mix_above_one', 'mix=1.5', 'algorithm.mix'),
      ('outer_rate', 'outer_learning_rate=-1.0', 'algorithm.outer_learning_rate'),
      ('outer_momentum', 'outer_momentum=1.0', 'algorithm.outer_momentum'))
  def test_bad_config_names_the_field(self, override, field):
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(harness.synthetic_config(f'streaming_diloco,{override}'))
    self.assertEqual(raised.exception.field, field)


class StreamingAverageRuleTest(parameterized.TestCase):

  def test_one_fragment_no_delay_is_local_sgd_time(self):
    kwargs = dict(workers=8, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', bandwidth_gbps=0.1))
    block = helpers.clock(sd.StreamingAverage(period=4, fragments=1, delay=0), **kwargs).next_block(20)
    periodic = local_sgd.PeriodicAverage(averages_at=lambda t: bool(local_sgd.averages_at(t, 4)))
    want = helpers.clock(periodic, **kwargs).next_block(20)
    np.testing.assert_allclose(block.sim_time, want.sim_time, rtol=1e-12)
    np.testing.assert_allclose(block.idle, want.idle, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(block.bytes_communicated, want.bytes_communicated)

  def test_one_fragment_per_sync_and_peak_bytes_fall_f_fold(self):
    m, p = 1e6, 8
    for fragments in (1, 2, 4):
      block = helpers.clock(sd.StreamingAverage(period=4, fragments=fragments, delay=1), workers=p,
                            model_bytes=m, base_s=X).next_block(8)
      want = np.where(np.isin(np.arange(8) % 4, np.flatnonzero(sd.sync_table(4, fragments) >= 0)),
                      network_lib.ring_bytes(m / fragments, p), 0.0)
      np.testing.assert_allclose(block.bytes_communicated, want, rtol=1e-12)
      np.testing.assert_allclose(block.measurements['sync_bytes'], want, rtol=1e-12)
      self.assertAlmostEqual(block.bytes_communicated.sum(), 2 * network_lib.ring_bytes(m, p))  # per round: M

  def test_communication_hidden_under_the_delay_or_exposed(self):
    # Constant compute X; one fragment of M / 2 all-reduced in `cost` seconds; merged d = 1 step later.
    network = dict(kind='alpha_beta', latency_s=0.0, bandwidth_gbps=8e-3)  # 1e6 bytes/s
    p, m = 2, 8e3                         # allreduce(M / 2, 2) = 2 * 1/2 * 4e3 / 1e6 = 4 ms < X: hidden
    rule = sd.StreamingAverage(period=4, fragments=2, delay=1)
    block = helpers.clock(rule, workers=p, model_bytes=m, base_s=X, network=network).next_block(8)
    np.testing.assert_allclose(block.sim_time, X * np.arange(1, 9), rtol=1e-12)
    np.testing.assert_array_equal(block.idle, 0.0)
    slow = helpers.clock(rule, workers=p, model_bytes=10 * m, base_s=X, network=network).next_block(8)
    exposed = 0.04 - X                    # 40 ms all-reduce, one step of it hidden
    np.testing.assert_allclose(slow.sim_time[:3], [X, 2 * X, 3 * X + exposed], rtol=1e-12)
    np.testing.assert_allclose(slow.idle[2], exposed, rtol=1e-9)
    blocking = helpers.clock(sd.StreamingAverage(period=4, fragments=2, delay=0), workers=p, model_bytes=10 * m,
                             base_s=X, network=network).next_block(2)
    np.testing.assert_allclose(blocking.sim_time, [X, 2 * X + 0.04], rtol=1e-12)

  def test_state_survives_a_json_round_trip(self):
    rule = sd.StreamingAverage(period=4, fragments=2, delay=3)
    kwargs = dict(workers=4, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', bandwidth_gbps=0.01))
    whole = helpers.clock(rule, **kwargs).next_block(12)
    first = helpers.clock(rule, **kwargs)
    first.next_block(5)
    resumed = helpers.clock(rule, **kwargs)
    resumed.load_state_dict(helpers.json_round_trip(first.state_dict()))
    np.testing.assert_allclose(resumed.next_block(7).sim_time, whole.sim_time[5:], rtol=1e-12)


if __name__ == '__main__':
  absltest.main()
