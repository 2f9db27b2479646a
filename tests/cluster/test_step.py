"""A synchronous step's own terms (`cluster/step.py`): the all-reduce's overlap with the backward pass, by hand
and at its limits, and the slowest of P workers."""

import math

from absl.testing import absltest

from waitless.cluster import network
from waitless.cluster import stacks
from waitless.cluster import step


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

  def test_horovod_by_hand(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)
    s, m, n, bk = mpich(f), 1e8, 8, 0.2
    k = max(math.ceil(m / 64e6), math.ceil(bk / 5e-3))  # 40 cycles
    self.assertEqual(step.calls(s, m, bk), k)
    per_call = mpich().allreduce(m / k, n) + 2 * 3 * 2e-6
    expected = max(per_call, k * per_call - (k - 1) * bk / k) + 2.5e-3
    self.assertAlmostEqual(step.exposed(s, m, n, bk), expected)

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
    busy = step.exposed(mpich(f), 5e8, 128, 0.05)  # saturated: all of the coordinator's work is exposed
    idle = step.exposed(mpich(stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)), 5e8, 128, 0.05)
    self.assertAlmostEqual(busy - idle, 128 * 161 * 1e-6)


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
