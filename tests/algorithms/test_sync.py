"""Synchronous SGD: P workers x batch b is single-device SGD with batch P*b (float64, replayed events)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import optax

from waitless.algorithms import sync
from tests import harness
from tests.algorithms import reference


def _f64(**overrides):
  return harness.synthetic_config('sync', **{'model.param_dtype': 'float64', 'model.dtype': 'float64',
                                             **overrides})


class SyncTest(parameterized.TestCase):

  @parameterized.named_parameters(('plain', 0.0), ('momentum', 0.9))
  def test_equals_single_device_sgd_with_the_concatenated_batch(self, momentum):
    iterations = 8
    with jax.enable_x64(True):
      config = _f64(**{'optimizer.momentum': momentum})
      traj = harness.run_iterations(config, iterations)
    w, b = reference.unpack(traj.initial_params)
    opt = reference.MomentumSGD(config.optimizer.learning_rate, momentum)
    for t in range(iterations):
      parts = [harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1) for i in range(config.workers)]
      x = np.concatenate([p['image'][0] for p in parts])
      y = np.concatenate([p['label'][0] for p in parts])
      self.assertEqual(len(y), config.workers * config.batch_size)
      gw, gb = reference.gradient(w, b, x, y)
      w, b = opt.step([w, np.float64(b)], [gw, np.float64(gb)])
      for worker in range(config.workers):
        got_w, got_b = reference.unpack(traj.params[t], worker)
        np.testing.assert_allclose(got_w, w, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(got_b, b, rtol=1e-11, atol=1e-13)

  def test_workers_on_fewer_devices_give_the_same_trajectory(self):
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(workers=8, devices=d), 6, block=3) for d in (8, 2, 1)]
    for other in runs[1:]:
      for a, b in zip(runs[0].params, other.params):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  def test_one_worker_is_the_inner_optimizer(self):
    params = {'w': np.array([1.0, -2.0])}
    grads = {'w': np.array([0.5, 0.25])}
    inner = optax.sgd(0.1, momentum=0.9)
    tx = sync.sync_sgd(inner, axis_name=None)
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = inner.update(grads, inner.init(params), params)
    np.testing.assert_allclose(got['w'], want['w'])


if __name__ == '__main__':
  absltest.main()
