"""Local SGD: sequential float64 reference, H = 1 is sync, post-local warmup, optional momentum averaging."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.algorithms import local_sgd
from tests import harness
from tests.algorithms import reference


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


class LocalSGDTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('h3', 3, 0, 0.0, False),
      ('h3_momentum', 3, 0, 0.9, False),
      ('post_local', 4, 3, 0.9, False),
      ('average_momentum', 2, 0, 0.9, True))
  def test_matches_sequential_reference(self, local_steps, warmup_steps, momentum, average_opt_state):
    iterations = 11
    arg = f'local_sgd,local_steps={local_steps},warmup_steps={warmup_steps},average_opt_state={average_opt_state}'
    with jax.enable_x64(True):
      config = _f64(arg, **{'optimizer.momentum': momentum})
      traj = harness.run_iterations(config, iterations)
    p = config.workers
    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]
    for t in range(iterations):
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(models[i][0], models[i][1], batch['image'][0], batch['label'][0])
        models[i] = opts[i].step(models[i], [gw, np.float64(gb)])
      if local_sgd.averages_at(t, local_steps, warmup_steps):
        mean = [np.mean([m[k] for m in models], axis=0) for k in range(2)]
        models = [list(mean) for _ in range(p)]
        if average_opt_state and momentum:
          trace = [np.mean([o.trace[k] for o in opts], axis=0) for k in range(2)]
          for o in opts:
            o.trace = list(trace)
      for i in range(p):
        got_w, got_b = reference.unpack(traj.params[t], i)
        np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
        np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)

  def test_models_differ_between_averages_and_agree_after(self):
    traj = harness.run_iterations(harness.synthetic_config('local_sgd,local_steps=3'), 6)
    kernel = lambda t: traj.params[t]['Dense_0']['kernel']
    self.assertGreater(np.abs(kernel(0)[0] - kernel(0)[1]).max(), 1e-6)
    np.testing.assert_allclose(kernel(2)[0], kernel(2)[1], rtol=1e-6)

  def test_one_local_step_with_plain_sgd_is_sync(self):
    with jax.enable_x64(True):
      local = harness.run_iterations(_f64('local_sgd,local_steps=1'), 8)
      sync = harness.run_iterations(_f64('sync'), 8)
    for a, b in zip(local.params, sync.params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13), a, b)

  def test_averages_at(self):
    self.assertEqual([bool(local_sgd.averages_at(t, 3, 2)) for t in range(8)],
                     [True, True, False, False, True, False, False, True])

  def test_workers_on_fewer_devices_give_the_same_trajectory(self):
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64('local_sgd,local_steps=2', workers=8, devices=d), 6, block=3)
              for d in (8, 4)]
    for a, b in zip(runs[0].params, runs[1].params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_whole_round_blocks_equal_the_per_iteration_path(self, devices):
    # block=6 with H=3: whole rounds (static round_position, unconditional average); block=4: blocks that
    # start or end inside a round take the per-iteration path (conditional average); block=1: per iteration.
    with jax.enable_x64(True):
      config = _f64('local_sgd,local_steps=3', **{'optimizer.momentum': 0.9, 'devices': devices})
      runs = {block: harness.run_iterations(config, 12, block=block) for block in (1, 4, 6)}
    self.assertEqual(runs[6].run.round_length, 3)
    self.assertEqual(runs[6].block_step.rounds._cache_size(), 1)
    for block in (4, 6):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14),
                   runs[block].params[-1], runs[1].params[-1])

  def test_post_local_warmup_has_no_fixed_round(self):
    self.assertIsNone(local_sgd.round_length(_f64('local_sgd,local_steps=4,warmup_steps=2')))
    self.assertEqual(local_sgd.round_length(_f64('local_sgd,local_steps=4')), 4)


if __name__ == '__main__':
  absltest.main()
