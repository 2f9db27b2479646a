"""Compute-time models, transient delays and failures."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.cluster.rules import sync
from waitless.cluster import compute
from waitless.cluster import faults
from tests.cluster import helpers

N = 200_000


class DistributionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('constant', compute.Constant(0.01)),
      ('exponential', compute.Exponential(rate=50.0)),
      ('shifted_exponential', compute.ShiftedExponential(shift_s=0.01, rate=50.0)),
      ('pareto', compute.Pareto(shape=4.0, scale=0.01)),
      ('lognormal', compute.Lognormal(base_s=0.01, sigma=0.3)),
  )
  def test_sample_mean_matches_model_mean(self, model):
    rng = np.random.default_rng(0)
    x = model.sample(rng, np.zeros(N, np.int64), np.arange(N))
    self.assertEqual(x.dtype, np.float64)
    self.assertTrue(np.all(x > 0))
    self.assertLess(abs(x.mean() - model.mean()), 5 * x.std() / np.sqrt(N) + 1e-15)

  def test_pareto_support_and_lognormal_median(self):
    rng = np.random.default_rng(1)
    self.assertGreaterEqual(compute.Pareto(1.5, 0.02).sample(rng, np.zeros(1000), np.zeros(1000)).min(), 0.02)
    median = np.median(compute.Lognormal(0.01, 1.0).sample(rng, np.zeros(N), np.zeros(N)))
    self.assertAlmostEqual(median, 0.01, delta=2e-4)

  def test_slow_workers_scale_any_model(self):
    model = compute.SlowWorkers(compute.Constant(0.01), np.array([1.0, 3.0]))
    np.testing.assert_allclose(model.sample(None, np.array([0, 1, 1]), np.zeros(3)), [0.01, 0.03, 0.03])
    self.assertAlmostEqual(model.mean(), 0.02)

  def test_slow_fraction_picks_the_first_workers(self):
    clock = helpers.clock(sync.Barrier(), workers=8, slow_fraction=0.25, slow_factor=4.0)
    np.testing.assert_allclose(clock.compute.factors, [4, 4, 1, 1, 1, 1, 1, 1])
    clock = helpers.clock(sync.Barrier(), workers=8, kind='slow_workers', slow_workers=(3, 5))
    np.testing.assert_allclose(clock.compute.factors, [1, 1, 1, 2, 1, 2, 1, 1])


class TraceTest(absltest.TestCase):

  def test_csv_with_header_replays_by_position_and_wraps(self):
    path = self.create_tempfile('t.csv', content='w0,w1\n0.1,0.2\n0.3,0.4\n').full_path
    model = compute.Trace(compute.load_trace(path, 2))
    np.testing.assert_allclose(model.sample(None, np.array([0, 1, 0, 1]), np.array([0, 0, 1, 2])),
                               [0.1, 0.2, 0.3, 0.2])

  def test_npy_through_the_clock(self):
    path = self.create_tempfile('t.npy').full_path
    np.save(path, np.array([[0.01, 0.02], [0.03, 0.01]]))
    block = helpers.clock(sync.Barrier(), workers=2, kind='trace', trace_path=path).next_block(4)
    np.testing.assert_allclose(block.duration, [0.02, 0.03, 0.02, 0.03])

  def test_bad_trace(self):
    with self.assertRaisesRegex(errors.ConfigError, 'stragglers.trace_path.*not found'):
      compute.load_trace('/nonexistent/trace.csv', 2)
    path = self.create_tempfile('t.csv', content='0.1,0.2,0.3\n').full_path
    with self.assertRaisesRegex(errors.ConfigError, r'stragglers.trace_path.*workers=2.*\(1, 3\)'):
      compute.load_trace(path, 2)
    path = self.create_tempfile('n.csv', content='0.1,-0.2\n').full_path
    with self.assertRaisesRegex(errors.ConfigError, 'finite number > 0'):
      compute.load_trace(path, 2)


class RandomDelayTest(absltest.TestCase):

  def test_exactly_count_workers_per_job_index(self):
    delay = faults.RandomDelay(count=2, delay_s=0.32, workers=64, seed=3)
    jobs = np.repeat(np.arange(500), 64)
    workers = np.tile(np.arange(64), 500)
    seconds = delay.delays(workers, jobs).reshape(500, 64)
    np.testing.assert_array_equal((seconds > 0).sum(axis=1), 2)
    self.assertTrue(np.all((seconds == 0) | (seconds == 0.32)))
    self.assertGreater(len({tuple(np.flatnonzero(row)) for row in seconds}), 400)  # a new pair each step
    counts = (seconds > 0).sum(axis=0)  # every worker is hit about equally often (1000 hits / 64)
    self.assertGreater(counts.min(), 3)
    self.assertLess(counts.max(), 35)
    # Stateless: the same job index of a worker is delayed whenever it is asked, in any order.
    np.testing.assert_array_equal(delay.delays(workers[::-1], jobs[::-1]), seconds.reshape(-1)[::-1])

  def test_independent_draws_coincide_as_often_as_two_uniform_draws(self):
    # The WAGMA authors' injection: two uniform draws of a rank per step, which coincide with probability 1/P.
    p, steps = 4, 4000
    delay = faults.RandomDelay(count=2, delay_s=0.32, workers=p, seed=3, independent=True)
    jobs, workers = np.repeat(np.arange(steps), p), np.tile(np.arange(p), steps)
    seconds = delay.delays(workers, jobs).reshape(steps, p)
    hit = (seconds > 0).sum(axis=1)
    self.assertEqual(set(hit.tolist()), {1, 2})
    self.assertAlmostEqual(float(np.mean(hit == 1)), 1 / p, delta=0.03)  # 0.25 +- 4.5 standard errors
    self.assertEqual(delay.delay_of(int(np.flatnonzero(seconds[7])[0]), 7), 0.32)
    # count >= P still draws: P independent draws leave some workers out.
    everyone = faults.RandomDelay(count=p, delay_s=0.32, workers=p, seed=3, independent=True)
    self.assertLess(float(np.mean(everyone.delays(workers, jobs) > 0)), 0.8)

  def test_barrier_pays_the_delay_every_iteration(self):
    clock = helpers.clock(sync.Barrier(), workers=64, base_s=0.01, kind='random_delay', delayed_workers=2,
                          delay_s=0.32)
    block = clock.next_block(20)
    np.testing.assert_allclose(block.duration, 0.33)
    np.testing.assert_array_equal((block.idle > 0.3).sum(axis=1), 62)


class FailureModelTest(absltest.TestCase):

  def test_interrupted_and_down_micro_batches(self):
    failure = faults.Failure(failed=(1,), fail_at_s=1.0, return_at_s=5.0)
    finish = failure.run(np.array([0, 1, 1, 1, 1]), np.array([0.5, 0.5, 2.0, 0.2, 6.0]),
                         np.array([1.0, 1.0, 1.0, 0.5, 1.0]))
    np.testing.assert_allclose(finish, [1.5, 6.0, 6.0, 0.7, 7.0])
    forever = faults.Failure(failed=(1,), fail_at_s=1.0)
    self.assertEqual(forever.permanent, 1)
    self.assertTrue(np.isinf(forever.run(np.array([1]), np.array([0.5]), np.array([1.0]))[0]))


if __name__ == '__main__':
  absltest.main()
