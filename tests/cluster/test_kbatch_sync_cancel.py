"""K-batch-sync's `cancel`: the paper's cancellation at the update against a real runtime's discard on arrival,
on traces whose events can be followed by hand, against a sequential reference written from the rule's
docstring, and against Rennala SGD event by event (ALGORITHMS.md: Rennala is K-batch-sync with K = B)."""

import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from tests.cluster import helpers

NETWORK = {'kind': 'alpha_beta', 'latency_s': 0.05, 'bandwidth_gbps': 0.08}  # p2p(1e6 bytes) = 0.15 s


def reference(times, k, updates, up):
  """(update times, contributions (updates, P)) of K-batch-sync with late jobs discarded on arrival, one event
  at a time in float64: learner i's j-th job takes times[j, i]; a job reaches the server `up` after it ends and
  the reply `up` later; the learner computes its next job on the reply's model, which is W_{t+1} after the K-th
  push of update t and W_t otherwise; a job computed on an older model than the server's is discarded."""
  p = times.shape[1]
  finish = [float(times[0, i]) for i in range(p)]
  jobs = [1] * p
  view, version, ends, counts = [0] * p, 0, [], []
  for _ in range(updates):
    c, taken = [0] * p, 0
    while taken < k:
      i = min(range(p), key=lambda j: (finish[j], j))
      arrival = finish[i] + up
      if view[i] < version:
        view[i] = version
      else:
        c[i] += 1
        taken += 1
        view[i] = version + 1 if taken == k else version
      finish[i] = arrival + up + float(times[jobs[i], i])
      jobs[i] += 1
    version += 1
    ends.append(arrival)
    counts.append(c)
  return np.array(ends), np.array(counts)


class CancelTest(parameterized.TestCase):

  def _clock(self, rule, times, network=None):
    path = os.path.join(self.create_tempdir().full_path, 'trace.npy')
    np.save(path, np.asarray(times, np.float64))
    return helpers.clock(rule, workers=np.shape(times)[1], kind='trace', trace_path=path,
                         network=network or {'kind': 'ideal'})

  def test_immediate_restarts_every_learner_on_the_new_model_at_once(self):
    # Learners take 1.0 and 1.2 s, K = 2: update 0 at 1.2 (learner 0 at 1.0, learner 1 at 1.2); learner 0's second
    # job (1.0 -> 2.0) is cancelled and both restart at 1.2: update 1 at 2.4.
    block = self._clock(kbatch_sync.KBatchSync(2), [[1.0, 1.2]] * 6).next_block(2)
    np.testing.assert_allclose(block.sim_time, [1.2, 2.4])

  def test_on_arrival_a_late_job_runs_to_its_end_and_is_discarded(self):
    # The same trace: learner 0's second job runs to 2.0 on W_0, is discarded on arrival and learner 0 restarts on
    # W_1: its next gradient is there at 3.0, after learner 1's second (2.4): update 1 at 3.0.
    block = self._clock(kbatch_sync.KBatchSync(2, cancel='on_arrival'), [[1.0, 1.2]] * 6).next_block(2)
    np.testing.assert_allclose(block.sim_time, [1.2, 3.0])
    np.testing.assert_array_equal(block.schedule.contributions, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(block.measurements['discarded'], [0, 1])
    np.testing.assert_array_equal(block.schedule.staleness, 0)  # the update takes gradients at W_t only
    np.testing.assert_array_equal(block.schedule.refresh_view, True)

  def test_on_arrival_a_learner_waits_for_the_reply_to_each_push(self):
    # Two learners, jobs of 1 s, p2p 0.15 s, K = 2. Immediate: both finish at 1.0, update, restart at 1.3: 1.3 per
    # update. On arrival: both pushes arrive at 1.15 (learner 0's taken, its reply W_0; learner 1's the K-th:
    # update 0, its reply W_1), replies at 1.3, both arrive again at 2.45: learner 0's job on W_0 discarded,
    # learner 1's taken; replies at 2.6 (both W_1), both arrive at 3.75: learner 0's the K-th (update 1), then
    # learner 1's (on W_1: discarded in update 2); at 5.05 both on W_2: update 2. Three arrivals an update.
    times = [[1.0, 1.0]] * 8
    immediate = self._clock(kbatch_sync.KBatchSync(2), times, NETWORK).next_block(3)
    arrival = self._clock(kbatch_sync.KBatchSync(2, cancel='on_arrival'), times, NETWORK).next_block(3)
    np.testing.assert_allclose(immediate.sim_time, [1.3, 2.6, 3.9])
    np.testing.assert_allclose(arrival.sim_time, [1.15, 3.75, 5.05])
    np.testing.assert_array_equal(arrival.schedule.contributions, [[1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(arrival.measurements['discarded'], [0, 1, 1])

  @parameterized.parameters(({'kind': 'ideal'},), (NETWORK,))
  def test_one_learner_costs_the_same_either_way(self, network):
    # Nothing is in flight at an update: the two rules coincide but for where an update ends (immediate: when the
    # learner has the new model, p2p(M) after the server's update). Constant jobs: immediate also draws the job
    # it cancels, so a trace's rows would not line up.
    times = np.full((40, 1), 0.01)
    a = self._clock(kbatch_sync.KBatchSync(1), times, network).next_block(10)
    b = self._clock(kbatch_sync.KBatchSync(1, cancel='on_arrival'), times, network).next_block(10)
    up = 0.0 if network['kind'] == 'ideal' else 0.15
    np.testing.assert_allclose(b.sim_time + up, a.sim_time, rtol=1e-12)
    np.testing.assert_array_equal(b.schedule.contributions, a.schedule.contributions)

  @parameterized.parameters((4, 3, None), (4, 3, NETWORK), (5, 3, NETWORK), (2, 2, NETWORK))
  def test_matches_the_sequential_reference(self, p, k, network):
    times = np.random.default_rng(p * k).exponential(0.1, (400, p))
    clock = self._clock(kbatch_sync.KBatchSync(k, cancel='on_arrival'), times, network)
    block = clock.next_block(40)
    up = 0.0 if network is None else 0.15
    ends, counts = reference(times, k, 40, up)
    np.testing.assert_allclose(block.sim_time, ends, rtol=1e-12)
    np.testing.assert_array_equal(block.schedule.contributions, counts)
    self.assertGreater(block.measurements['discarded'].sum(), 0, 'nothing discarded: the test would not exercise it')

  @parameterized.parameters(('exponential', {'rate': 100.0}), ('shifted_exponential', {'shift_s': 0.01, 'rate': 50.0}))
  def test_is_rennala_event_by_event(self, kind, stragglers):
    # ALGORITHMS.md: Rennala SGD with batch B is K-batch-sync with K = B; Rennala event by event is K-batch-async
    # with max_delay = 1. With cancel=on_arrival K-batch-sync has Rennala's times, contributions and discards.
    make = lambda rule: helpers.clock(rule, workers=6, seed=3, kind=kind, network=NETWORK, model_bytes=1e5,
                                      **stragglers).next_block(300)
    a = make(kbatch_sync.KBatchSync(4, cancel='on_arrival'))
    b = make(kbatch_async.KBatchAsync(4, max_delay=1))
    np.testing.assert_array_equal(a.sim_time, b.sim_time)
    np.testing.assert_array_equal(a.schedule.contributions, b.schedule.contributions)
    np.testing.assert_array_equal(a.measurements['discarded'], b.measurements['discarded'])
    np.testing.assert_array_equal(a.bytes_communicated, b.bytes_communicated)

  def test_immediate_keeps_its_closed_form(self):
    # ALGORITHMS.md: K / (P mu) per update (the paper's rule; on_arrival is slower: late jobs are lost).
    make = lambda cancel: helpers.clock(kbatch_sync.KBatchSync(3, cancel=cancel), workers=4, seed=1,
                                        kind='exponential', rate=100.0).next_block(4000)
    immediate, arrival = make('immediate'), make('on_arrival')
    self.assertAlmostEqual(immediate.sim_time[-1] / 4000, 3 / (4 * 100.0), delta=0.03 * 3 / 400)
    self.assertGreater(arrival.sim_time[-1], 1.3 * immediate.sim_time[-1])

  def test_unknown_cancel_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'cancel'):
      kbatch_sync.KBatchSync(k=2, cancel='never')


if __name__ == '__main__':
  absltest.main()
