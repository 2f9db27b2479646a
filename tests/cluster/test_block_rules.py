"""The vectorised simulator (`iterate_block`) of sync, local SGD, D-PSGD, non-blocking SGD, WAGMA, DaSGD,
Streaming DiLoCo and LAP-SGD / LPP-SGD against their per-iteration rules (`iterate`).

`Clock._block` runs a rule one `iterate` at a time (the float reference); `Clock.next_block` runs
`iterate_block`, which draws the compute times of the whole block at once. Both must give identical schedules,
times, idle times, idle fractions, bytes and measurements, and leave the generator, the unit and job counters
and the rule's state identical: over uneven blocks, several seeds, micro-batches, straggler models (ties
included), transient delays, traces, failures (those fall back to `iterate`) and networks. A resumed run must
continue exactly, whatever the block boundaries before and after the checkpoint.
"""

import os
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import dasgd
from waitless.cluster.rules import dpsgd
from waitless.cluster.rules import lap_sgd
from waitless.cluster.rules import local_sgd
from waitless.cluster.rules import matcha
from waitless.cluster.rules import nonblocking
from waitless.cluster.rules import streaming_diloco
from waitless.cluster.rules import sync
from waitless.cluster.rules import wagma
from tests.cluster import helpers

P = 16
STRAGGLERS = {
    'exponential': {'kind': 'exponential', 'rate': 100.0},
    'pareto': {'kind': 'pareto', 'shape': 1.5, 'scale': 0.01},
    'constant_ties': {'kind': 'constant', 'base_s': 0.01},
    # Spread (~1 us) below WAGMA's activation hop (10 us): many first arrivals, the full relaxation.
    'near_ties': {'kind': 'lognormal', 'base_s': 0.01, 'sigma': 1e-4},
    'slow_workers': {'kind': 'shifted_exponential', 'shift_s': 0.005, 'rate': 200.0, 'slow_fraction': 0.25,
                     'slow_factor': 3.0},
    'random_delay': {'kind': 'exponential', 'rate': 100.0, 'delayed_workers': 2, 'delay_s': 0.03},
    # A per-call overhead, scaled by the slow factor; LAP-SGD's threads share it (`per_call`).
    'overhead_slow': {'kind': 'exponential', 'rate': 150.0, 'overhead_s': 0.003, 'slow_workers': (2, 9),
                      'slow_factor': 2.0, 'delayed_workers': 1, 'delay_s': 0.01},
    'trace_delay': {'kind': 'trace', 'delayed_workers': 3, 'delay_s': 0.02},
    'failure_returns': {'kind': 'exponential', 'rate': 100.0, 'fail_worker': (1, 5), 'fail_at_s': 0.2,
                        'return_at_s': 0.5},
}
RULES = {
    'sync': lambda: sync.Barrier(),
    'sync_m3': lambda: sync.Barrier(3),
    'local_sgd_h4': lambda: local_sgd.PeriodicAverage(lambda t: (t + 1) % 4 == 0),
    'local_sgd_warmup_m2': lambda: local_sgd.PeriodicAverage(lambda t: t < 5 or (t + 1) % 7 == 0, 2),
    'dpsgd': lambda: dpsgd.RingGossip(),
    'dpsgd_overlap_m2': lambda: dpsgd.RingGossip(2, order='overlap'),
    'matcha_m2': lambda: matcha.MatchingGossip(0.4, seed=5, microbatches=2),
    'nonblocking_m4': lambda: nonblocking.NonBlocking(4),
    'nonblocking_deadline': lambda: nonblocking.NonBlocking(3, trigger='deadline', deadline_s=0.02),
    'nonblocking_ring_m1': lambda: nonblocking.NonBlocking(1, topology='ring'),
    'wagma': lambda: wagma.WaitAvoidingGroups(4, 10),
    'wagma_m2_tau3': lambda: wagma.WaitAvoidingGroups(2, 3, microbatches=2),
    'wagma_fixed_no_latency': lambda: wagma.WaitAvoidingGroups(8, 7, fixed_groups=True, activation_latency_s=0.0),
    'wagma_not_wait_avoiding': lambda: wagma.WaitAvoidingGroups(4, 5, wait_avoiding=False),
    'wagma_step_then_average': lambda: wagma.WaitAvoidingGroups(4, 10, rule='step_then_average'),
    'wagma_step_then_average_not_wait_avoiding': lambda: wagma.WaitAvoidingGroups(
        2, 4, wait_avoiding=False, rule='step_then_average'),
    'wagma_aligned_patterns_s8': lambda: wagma.WaitAvoidingGroups(8, 6, group_patterns='aligned'),
    'dasgd': lambda: dasgd.DelayedAverage(4, 1),
    'dasgd_blocking_d0_m2': lambda: dasgd.DelayedAverage(3, 0, microbatches=2),
    'dasgd_d_is_tau': lambda: dasgd.DelayedAverage(5, 5),
    'dasgd_tau1': lambda: dasgd.DelayedAverage(1, 1),  # every snapshot applies the previous mean first
    'streaming_diloco': lambda: streaming_diloco.StreamingAverage(4, 2, 1),
    'streaming_diloco_d0_m2': lambda: streaming_diloco.StreamingAverage(6, 3, 0, microbatches=2),
    'streaming_diloco_d_is_h_f1': lambda: streaming_diloco.StreamingAverage(3, 1, 3),
    'lap_sgd': lambda: lap_sgd.NodeThreads(4, lambda t: (t + 1) % 16 == 0),  # d from the network
    'lap_sgd_period_below_delay_m2': lambda: lap_sgd.NodeThreads(3, lambda t: (t + 1) % 2 == 0, 2, delay_steps=5),
    'lap_sgd_q1_d0': lambda: lap_sgd.NodeThreads(1, lambda t: (t + 1) % 4 == 0, delay_steps=0),
    'lap_sgd_post_local': lambda: lap_sgd.NodeThreads(2, lambda t: t < 6 or (t + 1) % 5 == 0, delay_steps=2),
    # Partial steps from update 6: the partial flag changes inside a draw of Q*m micro-batches.
    'lpp_sgd_partial_cost': lambda: lap_sgd.NodeThreads(4, lambda t: (t + 1) % 8 == 0, delay_steps=3,
                                                        prepass_steps=6, partial_cost=0.3),
}
BLOCKS = (300, 1, 37, 62)  # 400 iterations in uneven blocks


def _trace(directory: str, workers: int) -> str:
  path = os.path.join(directory, 'trace.npy')
  np.save(path, np.random.default_rng(3).uniform(0.005, 0.03, size=(37, workers)))
  return path


def _cases():
  seed = 0
  for rule in RULES:
    for name in STRAGGLERS:
      seed += 1
      yield f'{rule}_{name}', rule, name, seed


def _concatenate(blocks):
  """The fields of consecutive blocks joined along the iteration axis."""
  out = {f'schedule.{k}': np.concatenate([getattr(b.schedule, k) for b in blocks]) for k in blocks[0].schedule._fields}
  for field in ('duration', 'sim_time', 'idle_fraction', 'mean_staleness', 'bytes_communicated', 'idle'):
    out[field] = np.concatenate([getattr(b, field) for b in blocks])
  for key in blocks[0].measurements:
    out[f'measurements.{key}'] = np.concatenate([b.measurements[key] for b in blocks])
  return out


class VectorisedMatchesIterateTest(parameterized.TestCase):

  def _clock(self, make_rule, stragglers, seed, workers=P, network=None):
    stragglers = dict(stragglers)
    if stragglers['kind'] == 'trace':
      stragglers['trace_path'] = _trace(self.create_tempdir().full_path, workers)
    return helpers.clock(make_rule(), workers=workers, model_bytes=4e6, seed=seed,
                         network=network or {'kind': 'alpha_beta'}, **stragglers)

  def _compare(self, make_rule, stragglers, seed, workers=P, network=None, blocks=BLOCKS):
    loop = self._clock(make_rule, stragglers, seed, workers, network)
    fast = self._clock(make_rule, stragglers, seed, workers, network)
    self.assertTrue(fast.rule.vectorized)
    falls_back = 'fail_worker' in stragglers or (
        isinstance(fast.rule, nonblocking.NonBlocking) and stragglers['kind'] == 'trace')
    out = []
    for n in blocks:
      try:
        with np.errstate(invalid='ignore'):  # as `Clock.next_block` calls it: a lost worker's inf - inf
          a = loop._block(n)
      except Exception as e:
        with self.assertRaisesRegex(type(e), re.escape(str(e))):
          fast.next_block(n)
        break
      if falls_back:
        b = fast.next_block(n)
      else:
        with mock.patch.object(type(fast.rule), 'iterate', side_effect=AssertionError('iterate ran')):
          b = fast.next_block(n)
      helpers.assert_blocks_equal(self, a, b)  # idle fractions too: bit for bit
      out.append(b)
    np.testing.assert_array_equal(loop.times, fast.times)
    np.testing.assert_array_equal(loop.units, fast.units)
    np.testing.assert_array_equal(loop.jobs, fast.jobs)
    self.assertEqual(loop.sim_time, fast.sim_time)
    self.assertEqual(loop.iteration, fast.iteration)
    self.assertEqual(loop._rng.bit_generator.state, fast._rng.bit_generator.state)
    self.assertEqual(sorted(loop.rule_state), sorted(fast.rule_state))
    for key, value in loop.rule_state.items():
      np.testing.assert_array_equal(value, fast.rule_state[key], err_msg=key)
    return out

  @parameterized.named_parameters(*_cases())
  def test_identical(self, rule, stragglers, seed):
    self._compare(RULES[rule], STRAGGLERS[stragglers], seed)

  @parameterized.named_parameters(*((name, name) for name in RULES))
  def test_identical_at_64_workers_on_an_ideal_network(self, rule):
    self._compare(RULES[rule], STRAGGLERS['exponential'], 77, workers=64, network={'kind': 'ideal'},
                  blocks=(150, 51))

  @parameterized.named_parameters(('one', 1), ('two', 2), ('four', 4))
  def test_identical_on_tiny_clusters(self, workers):
    for name, make_rule in RULES.items():
      if 'wagma' in name and workers < 4:
        continue
      with self.subTest(name):
        self._compare(make_rule, STRAGGLERS['random_delay'], 5, workers=workers, blocks=(40, 3))

  def test_permanent_failure_stops_both_paths_at_the_same_iteration(self):
    stragglers = {'kind': 'exponential', 'rate': 100.0, 'fail_worker': (2,), 'fail_at_s': 0.3, 'return_at_s': -1}
    for name in ('sync', 'local_sgd_h4', 'dpsgd', 'wagma', 'dasgd', 'lap_sgd'):
      with self.subTest(name):
        self._compare(RULES[name], stragglers, 3)
    # Non-blocking SGD goes on without the lost worker.
    blocks = self._compare(RULES['nonblocking_m4'], stragglers, 3)
    self.assertEqual(sum(len(b.duration) for b in blocks), sum(BLOCKS))

  @parameterized.named_parameters(
      # Posting W' at the finish: with exponential noise one first arrival per group iteration (the table
      # lookup); near-ties: the relaxation, whose last step writes the group iteration's row of activations.
      ('step_then_average', 'wagma_step_then_average', {'exponential': (0, 20), 'near_ties': (170, 180)}),
      # Posting W(t) at the start: the members that waited for their group all start the next iteration at its
      # end (ties), so under exponential noise both paths are common.
      ('authors', 'wagma', {'exponential': (20, 160), 'near_ties': (170, 180)}))
  def test_wagma_takes_both_activation_paths(self, rule, bounds):
    for name, relaxed in bounds.items():
      clock = self._clock(RULES[rule], STRAGGLERS[name], 1)
      with mock.patch.object(np, 'minimum', wraps=np.minimum) as minimum:
        clock.next_block(200)
      rounds = minimum.call_count // 4  # log2(16) relaxation steps per relaxed iteration
      self.assertBetween(rounds, *relaxed)


class ResumeAcrossBlockBoundariesTest(parameterized.TestCase):
  """A checkpoint taken after any block, restored into a fresh clock that takes other blocks, continues the
  same run: block-sampled draws do not depend on where the blocks start."""

  @parameterized.named_parameters(*((name, name) for name in RULES))
  def test_resume_is_exact(self, rule):
    kwargs = dict(workers=P, model_bytes=4e6, seed=21, network={'kind': 'alpha_beta'}, kind='exponential',
                  rate=100.0, slow_workers=(1,), slow_factor=1.5, delayed_workers=1, delay_s=0.02)
    straight = helpers.clock(RULES[rule](), **kwargs)
    want = _concatenate([straight.next_block(n) for n in (60, 60, 60)])
    first = helpers.clock(RULES[rule](), **kwargs)
    blocks = [first.next_block(n) for n in (25, 8)]
    saved = helpers.json_round_trip(first.state_dict())
    restored = helpers.clock(RULES[rule](), **kwargs)
    restored.load_state_dict(saved)
    blocks += [restored.next_block(n) for n in (100, 1, 46)]
    got = _concatenate(blocks)
    self.assertEqual(sorted(got), sorted(want))
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=key)
    self.assertEqual(helpers.json_round_trip(straight.state_dict()), helpers.json_round_trip(restored.state_dict()))


class BlockIterationsTest(parameterized.TestCase):
  """`Block.iterations`: a block of n iterations cut into parts is the blocks of those parts drawn in turn (the
  training loop draws several blocks at once, `reader.BlockReader.prepare`), field by field and to the bit."""

  @parameterized.named_parameters(*((f'{rule}_{name}', rule, name) for rule in RULES
                                    for name in ('exponential', 'random_delay', 'failure_returns')))
  def test_parts_of_one_draw_equal_the_parts_drawn_in_turn(self, rule, stragglers):
    parts = (7, 1, 12, 4)
    clock = lambda: helpers.clock(RULES[rule](), workers=P, model_bytes=4e6, seed=9,
                                  network={'kind': 'alpha_beta'}, **STRAGGLERS[stragglers])
    one, turns = clock(), clock()
    whole = one.next_block(sum(parts))
    bounds = np.cumsum((0,) + parts)
    cut = [whole.iterations(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    drawn = [turns.next_block(n) for n in parts]
    for got, want in zip(cut, drawn):
      self.assertEqual(type(got.schedule), type(want.schedule))
      for key, value in _concatenate([want]).items():
        np.testing.assert_array_equal(_concatenate([got])[key], value, err_msg=key)
    self.assertEqual(helpers.json_round_trip(one.state_dict()), helpers.json_round_trip(turns.state_dict()))


if __name__ == '__main__':
  absltest.main()
