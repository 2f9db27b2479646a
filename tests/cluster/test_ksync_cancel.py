"""K-sync's `cancel`: the paper's cancellation at the update against a real runtime's discard on arrival, on a
trace whose events can be followed by hand."""

import os

from absl.testing import absltest
import numpy as np

from waitless.cluster.rules import ksync
from tests.cluster import helpers

# Seconds of job j (row) of worker w (column), P = 3: worker 0's first job and worker 1's second are slow.
TRACE = np.array([[3.0, 1.0, 1.0], [1.0, 3.0, 1.0]] + [[1.0, 1.0, 1.0]] * 8)


class CancelTest(absltest.TestCase):

  def _ends(self, cancel):
    path = os.path.join(self.create_tempdir().full_path, 'trace.npy')
    np.save(path, TRACE)
    clock = helpers.clock(ksync.KSync(k=2, cancel=cancel), workers=3, kind='trace', trace_path=path)
    block = clock.next_block(3)
    return block.sim_time, block.schedule.contributions

  def test_immediate_restarts_every_learner_on_the_new_model_at_once(self):
    # Update 0 at 1 (workers 1, 2); everyone restarts at 1 (worker 0's slow job cancelled): workers 0 and 2
    # finish their second jobs at 2.
    ends, contributions = self._ends('immediate')
    np.testing.assert_array_equal(ends, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(contributions[1], [1, 0, 1])

  def test_on_arrival_a_late_job_runs_to_its_end_and_is_discarded(self):
    # Update 0 at 1 (workers 1, 2). Worker 0's first job arrives at 3, computed on W_0: discarded; it restarts on
    # W_1 and arrives at 4, with worker 1's slow second job: update 1 at 4, worker 2 having waited since 2.
    ends, contributions = self._ends('on_arrival')
    np.testing.assert_array_equal(ends, [1.0, 4.0, 5.0])
    np.testing.assert_array_equal(contributions[1], [1, 0, 1])

  def test_constant_times_cost_the_same_either_way(self):
    a = helpers.clock(ksync.KSync(k=3, cancel='immediate'), workers=4).next_block(6)
    b = helpers.clock(ksync.KSync(k=3, cancel='on_arrival'), workers=4).next_block(6)
    np.testing.assert_allclose(a.sim_time, b.sim_time)

  def test_unknown_cancel_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'cancel'):
      ksync.KSync(k=2, cancel='never')


if __name__ == '__main__':
  absltest.main()
