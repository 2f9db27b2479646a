"""DiLoCo: sequential float64 reference, outer SGD of rate 1 without momentum is local SGD, config errors."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import diloco
from waitless.algorithms import local_sgd
from waitless.experiments.harness import validation
from tests import harness
from tests.algorithms import reference


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


class OuterSGD:
  """optax.sgd(lr, momentum, nesterov) on a list of arrays: v <- g + mu v; step g + mu v (Nesterov) or v."""

  def __init__(self, lr: float, momentum: float, nesterov: bool):
    self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
    self.trace = None

  def step(self, params, grads):
    if not self.momentum:
      return [p - self.lr * g for p, g in zip(params, grads)]
    if self.trace is None:
      self.trace = [np.zeros_like(g) for g in grads]
    self.trace = [g + self.momentum * v for g, v in zip(grads, self.trace)]
    direction = [g + self.momentum * v for g, v in zip(grads, self.trace)] if self.nesterov else self.trace
    return [p - self.lr * d for p, d in zip(params, direction)]


def assert_trees_close(a, b, rtol=1e-11, atol=1e-13):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


class DiLoCoTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('nesterov', 3, 0, 0.9, 0.7, 0.9, True, 4),
      ('heavy_ball_two_workers_per_device', 2, 0, 0.0, 0.5, 0.8, False, 2),
      ('post_local_warmup', 3, 2, 0.9, 0.7, 0.9, True, 4),
      ('plain_outer_sgd', 4, 0, 0.5, 1.3, 0.0, False, 4))
  def test_matches_sequential_reference(self, local_steps, warmup_steps, momentum, outer_lr, outer_momentum,
                                        nesterov, devices):
    iterations = 11
    arg = (f'diloco,local_steps={local_steps},warmup_steps={warmup_steps},outer_learning_rate={outer_lr},'
           f'outer_momentum={outer_momentum},outer_nesterov={nesterov}')
    with jax.enable_x64(True):
      config = _f64(arg, **{'optimizer.momentum': momentum, 'devices': devices})
      traj = harness.run_iterations(config, iterations)
    p = config.workers
    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    outer_model = list(models[0])
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]
    outer = OuterSGD(outer_lr, outer_momentum, nesterov)
    for t in range(iterations):
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(models[i][0], models[i][1], batch['image'][0], batch['label'][0])
        models[i] = opts[i].step(models[i], [gw, np.float64(gb)])
      if local_sgd.averages_at(t, local_steps, warmup_steps):
        mean = [np.mean([m[k] for m in models], axis=0) for k in range(2)]
        outer_model = outer.step(outer_model, [o - m for o, m in zip(outer_model, mean)])
        models = [list(outer_model) for _ in range(p)]
      for i in range(p):
        got_w, got_b = reference.unpack(traj.params[t], i)
        np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
        np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_outer_sgd_rate_one_without_momentum_is_local_sgd(self, devices):
    overrides = {'optimizer.momentum': 0.9, 'devices': devices}
    with jax.enable_x64(True):
      outer = _f64('diloco,local_steps=3,outer_learning_rate=1.0,outer_momentum=0.0,outer_nesterov=False',
                   **overrides)
      local = _f64('local_sgd,local_steps=3', **overrides)
      runs = [harness.run_iterations(c, 9) for c in (outer, local)]
    moved = np.abs(runs[1].params[-1]['Dense_0']['kernel'] - runs[1].initial_params['Dense_0']['kernel']).max()
    self.assertGreater(moved, 1e-3)
    for a, b in zip(runs[0].params, runs[1].params):
      assert_trees_close(a, b)

  def test_outer_momentum_changes_the_trajectory(self):
    # Guards the test above: the outer step is not silently the plain average.
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(f'diloco,local_steps=2,outer_momentum={mu}'), 6) for mu in (0.0, 0.9)]
    diff = np.abs(runs[0].params[-1]['Dense_0']['kernel'] - runs[1].params[-1]['Dense_0']['kernel']).max()
    self.assertGreater(diff, 1e-4)

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_whole_round_blocks_equal_the_per_iteration_path(self, devices):
    with jax.enable_x64(True):
      config = _f64('diloco,local_steps=3', **{'optimizer.momentum': 0.9, 'devices': devices})
      runs = {block: harness.run_iterations(config, 12, block=block) for block in (1, 4, 6)}
    self.assertEqual(runs[6].run.round_length, 3)
    self.assertEqual(runs[6].block_step.rounds._cache_size(), 1)
    for block in (4, 6):
      assert_trees_close(runs[block].params[-1], runs[1].params[-1], rtol=1e-12, atol=1e-14)

  def test_workers_restart_from_the_outer_model(self):
    traj = harness.run_iterations(harness.synthetic_config('diloco,local_steps=3'), 3)
    state = jax.device_get(traj.final_state.opt_state)
    kernel = traj.params[-1]['Dense_0']['kernel']
    np.testing.assert_allclose(kernel[0], kernel[1], rtol=1e-6)
    np.testing.assert_allclose(kernel, state.outer_params['Dense_0']['kernel'], rtol=1e-6)

  @parameterized.named_parameters(
      ('zero_rate', 'outer_learning_rate=0.0', 'algorithm.outer_learning_rate'),
      ('infinite_rate', 'outer_learning_rate=1e999', 'algorithm.outer_learning_rate'),
      ('momentum_one', 'outer_momentum=1.0', 'algorithm.outer_momentum'),
      ('negative_momentum', 'outer_momentum=-0.1', 'algorithm.outer_momentum'),
      ('zero_local_steps', 'local_steps=0', 'algorithm.local_steps'))
  def test_bad_config_names_the_field(self, override, field):
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(harness.synthetic_config(f'diloco,{override}'))
    self.assertEqual(raised.exception.field, field)

  def test_nesterov_must_be_a_bool(self):
    config = harness.synthetic_config('diloco')
    with config.algorithm.ignore_type():
      config.algorithm.outer_nesterov = 'yes'
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(config)
    self.assertEqual(raised.exception.field, 'algorithm.outer_nesterov')

  def test_defaults_are_the_papers(self):
    a = harness.synthetic_config('diloco').algorithm
    self.assertEqual((a.outer_learning_rate, a.outer_momentum, a.outer_nesterov), (0.7, 0.9, True))
    self.assertEqual(diloco.SPEC.round_length(harness.synthetic_config('diloco,local_steps=5')), 5)


if __name__ == '__main__':
  absltest.main()
