"""A synchronous step's own terms (`cluster/step.py`): the all-reduce's overlap with the backward pass, by hand
and at its limits, and the slowest of P workers."""

import dataclasses
import math

from absl.testing import absltest

import numpy as np

from waitless.cluster import clock as clock_lib
from waitless.cluster import compute
from waitless.cluster import faults
from waitless.cluster import network
from waitless.cluster import profiles
from waitless.cluster import stacks
from waitless.cluster import step
from waitless.cluster.rules import sync


def mpich(framework=None) -> stacks.Stack:
  return stacks.Stack(library='mpich', gpus_per_node=1, inter=network.AlphaBeta(2e-6, 80.0),
                      p2p_link=network.AlphaBeta(2e-6, 80.0), reduce_gbps=32.0, framework=framework)


class OverlapTest(absltest.TestCase):

  def test_no_framework_or_no_backward_pass_overlaps_nothing(self):
    plain = mpich()
    self.assertEqual(step.exposed(plain, 1e8, 8, 0.2), plain.allreduce(1e8, 8))
    horovod = mpich(stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3))
    self.assertEqual(step.exposed(horovod, 1e8, 8, 0.0), horovod.allreduce(1e8, 8))
    self.assertEqual(step.exposed(horovod, 1e8, 1, 0.2), 0.0)

  def test_horovod_cycles_by_hand(self):
    # Cycles keep up with the backward pass: each reduces what became ready in the last cycle; the step waits for
    # the last cycle's bytes, from the end of the backward pass.
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)
    s, m, n, bk = mpich(f), 1e8, 8, 0.2
    waits = []
    for phase in step.PHASES:
      last_tick = (math.ceil(bk / 5e-3 - phase) + phase) * 5e-3  # the first cycle start at or after bk
      before = (last_tick - 5e-3) / bk * m  # reduced by the cycle before it
      waits.append(last_tick - bk + mpich().allreduce(m - before, n) + 2 * 3 * 2e-6)
    self.assertAlmostEqual(step.exposed(s, m, n, bk), sum(waits) / 4)
    self.assertLess(step.exposed(s, m, n, bk), s.allreduce(m, n))

  def test_horovod_saturated_merges_into_fewer_calls(self):
    # Each cycle's work is longer than a cycle: the thread takes what is ready when it is free, so the step never
    # waits for more than the whole all-reduce after the backward pass, nor for less than the part beyond it (the
    # whole less its calls' mean waits for a cycle, which the overlapped thread does not pay, and one cycle).
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)
    s = stacks.Stack(library='nccl', gpus_per_node=1, inter=network.AlphaBeta(3.4e-6, 24.0),
                     p2p_link=network.AlphaBeta(9.6e-6, 24.0), framework=f)
    for n in (2, 12, 64):
      whole = s.allreduce(5.5e8, n)
      got = step.exposed(s, 5.5e8, n, 0.28)
      self.assertLess(got, whole, n)
      self.assertGreater(got, whole - math.ceil(5.5e8 / 64e6) * 2.5e-3 - 0.28 - 5e-3, n)

  def test_ddp_buckets_by_hand_and_a_short_backward_hides_less(self):
    f = stacks.Framework(fusion_bytes=25e6, cycle_s=0.0)
    s, m, n = mpich(f), 1e8, 16
    per_call = mpich().allreduce(m / 4, n)
    for bk in (1e-3, 0.05, 1.0):
      self.assertAlmostEqual(step.exposed(s, m, n, bk), max(per_call, 4 * per_call - 3 * bk / 4))
    self.assertLess(step.exposed(s, m, n, 1.0), step.exposed(s, m, n, 1e-3))
    self.assertLessEqual(step.exposed(s, m, n, 1.0), s.allreduce(m, n))
    self.assertAlmostEqual(step.exposed(s, m, n, 1.0), per_call)  # all but the last bucket hidden

  def test_the_coordinator_runs_on_the_same_thread(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3, tensors=161, request_s=1e-6)
    g = stacks.Framework(fusion_bytes=0.0, cycle_s=0.0, tensors=161, request_s=1e-6)  # buckets: one per tensor
    busy = step.exposed(mpich(g), 5e8, 128, 0.05)  # saturated: all of the coordinator's work is exposed
    idle = step.exposed(mpich(dataclasses.replace(g, request_s=0.0)), 5e8, 128, 0.05)
    self.assertAlmostEqual(busy - idle, 128 * 161 * 1e-6)
    self.assertGreater(step.exposed(mpich(f), 5e8, 128, 0.05),
                       step.exposed(mpich(dataclasses.replace(f, request_s=0.0)), 5e8, 128, 0.05))


class SyncRuleTest(absltest.TestCase):

  def _clock(self, net, rule, base_s=0.3):
    return clock_lib.Clock(workers=16, rule=rule, compute=compute.Constant(base_s), network=net,
                           model_bytes=1e8, seed=0)

  def test_the_sync_rule_charges_what_the_backward_pass_leaves(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3, backward_share=2 / 3)
    for m in (1, 3):
      clk = self._clock(mpich(f), sync.Barrier(m))
      clk.rule.iterate(clk, 0)
      expected = m * 0.3 + step.exposed(mpich(f), 1e8, 16, 2 / 3 * 0.3)
      np.testing.assert_allclose(clk.times, expected)
      self.assertLess(expected, m * 0.3 + mpich(f).allreduce(1e8, 16))
      block = self._clock(mpich(f), sync.Barrier(m))
      steps = block.rule.iterate_block(block, 0, 5)
      np.testing.assert_allclose(steps.times[-1], 5 * expected)

  def test_a_delay_is_not_backward_work(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3, backward_share=2 / 3)
    clk = clock_lib.Clock(workers=16, rule=sync.Barrier(), compute=compute.Constant(0.3), network=mpich(f),
                          model_bytes=1e8, seed=0, delay=faults.RandomDelay(count=2, delay_s=0.32, workers=16, seed=0))
    clk.rule.iterate(clk, 0)
    np.testing.assert_allclose(clk.times, 0.62 + step.exposed(mpich(f), 1e8, 16, 0.2))

  def test_without_backward_share_nothing_changes(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)
    clk = self._clock(mpich(f), sync.Barrier())
    clk.rule.iterate(clk, 0)
    self.assertEqual(clk.times[0], 0.3 + mpich(f).allreduce(1e8, 16))
    self.assertEqual(step.after_compute(network.Collectives(network.AlphaBeta(1e-5, 10.0),
                                                            network.AlphaBeta(1e-5, 10.0)), 1e8, 16, 0.3),
                     network.Collectives(network.AlphaBeta(1e-5, 10.0), network.AlphaBeta(1e-5, 10.0)).allreduce(
                         1e8, 16))

  def test_the_horovod_profiles_overlap(self):
    for name in ('piz_daint', 'piz_daint_nccl'):
      net = profiles.load(name).network
      self.assertAlmostEqual(net.framework.backward_share, 0.6667, msg=name)
      self.assertLess(step.after_compute(net, 1e8, 64, 0.27), net.allreduce(1e8, 64))
    self.assertIsNone(profiles.load('commodity_10gbe').network.framework
                      if isinstance(profiles.load('commodity_10gbe').network, stacks.Stack) else None)


class ParameterServerOverlapTest(absltest.TestCase):

  def test_by_hand(self):
    # Compute 0.6 s, backward share 2/3: forward 0.2 s, backward 0.4 s.
    self.assertAlmostEqual(step.ps_exposed(0.3, 0.6, 2 / 3, True), 0.1)  # pulls 0.1 past the forward, pushes hidden
    self.assertAlmostEqual(step.ps_exposed(0.3, 0.6, 2 / 3, False), 0.3)  # pulls after the step
    self.assertAlmostEqual(step.ps_exposed(0.5, 0.6, 2 / 3, True), 0.3 + 0.1)
    self.assertEqual(step.ps_exposed(0.1, 0.6, 2 / 3, True), 0.0)

  def test_no_compute_hides_nothing(self):
    # Without compute to run under, the two phases cost their sum: twice the one-direction exchange.
    self.assertAlmostEqual(step.ps_exposed(0.3, 0.0, 2 / 3, True), 0.6)


class SlowestTest(absltest.TestCase):

  def test_formula_and_limits(self):
    self.assertEqual(step.slowest(0.3, 1, 0.05), 0.3)
    self.assertEqual(step.slowest(0.3, 128, 0.0), 0.3)
    self.assertAlmostEqual(step.slowest(0.3, 128, 0.05), 0.3 * (1 + 0.05 * math.sqrt(2 * math.log(128))))

  def test_estimates_hold_their_values_in_their_ranges(self):
    for e in (step.BACKWARD_SHARE, step.STEP_CV):
      self.assertTrue(e.low <= e.value <= e.high, e)
      self.assertTrue(e.source.startswith('estimate'), e)


if __name__ == '__main__':
  absltest.main()
