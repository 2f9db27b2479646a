"""The inner optimizer U: learning-rate schedules and AdamW's moments, against their formulas."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import optimizers
from waitless.experiments.harness import validation
from waitless.experiments.configs import digits


def _optimizer_config(**fields):
  config = digits.get_config('sync')
  config.optimizer.update(fields)
  return config


class LearningRateScheduleTest(parameterized.TestCase):

  def test_rsqrt_is_the_transformer_lr_schedule_scaled_to_its_peak(self):
    warmup, peak = 400, 2e-3
    lr = optimizers.learning_rate_schedule(_optimizer_config(lr_schedule='rsqrt', learning_rate=peak,
                                                             warmup_steps=warmup).optimizer, 10_000)
    steps = np.array([1, 100, 399, 400, 401, 1600, 9_999])
    vaswani = 512 ** -0.5 * np.minimum(steps ** -0.5, steps * warmup ** -1.5)  # eq. 3, d_model = 512
    expected = vaswani * peak / (512 ** -0.5 * warmup ** -0.5)
    np.testing.assert_allclose([float(lr(s)) for s in steps], expected, rtol=1e-5)
    self.assertAlmostEqual(float(lr(1600)), peak / 2, places=9)

  def test_warmup_then_cosine_and_step(self):
    cosine = optimizers.learning_rate_schedule(
        _optimizer_config(lr_schedule='cosine', learning_rate=1.0, warmup_steps=10).optimizer, 110)
    self.assertAlmostEqual(float(cosine(5)), 0.5, places=6)
    self.assertAlmostEqual(float(cosine(60)), 0.5, places=6)  # half way through the decay
    self.assertAlmostEqual(float(cosine(110)), 0.0, places=6)
    step = optimizers.learning_rate_schedule(
        _optimizer_config(lr_schedule='step', learning_rate=1.0, decay_boundaries=(0.5,)).optimizer, 100)
    np.testing.assert_allclose([float(step(s)) for s in (49, 50, 51)], [1.0, 0.1, 0.1], rtol=1e-6)


class AdamWTest(absltest.TestCase):

  def test_moments_use_b1_b2_eps(self):
    opt = _optimizer_config(name='adamw', learning_rate=0.01, b1=0.8, b2=0.98, eps=1e-3, weight_decay=0.1)
    tx = optimizers.make_optimizer(opt.optimizer, 100)
    params = jnp.array([1.0, -2.0])
    grads = [np.array([0.5, 0.1]), np.array([-0.2, 0.3]), np.array([0.4, -0.4])]
    state = tx.init(params)
    m = v = np.zeros(2)
    expected = np.asarray(params, np.float64)
    for t, g in enumerate(grads, 1):
      updates, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
      params = params + updates
      m, v = 0.8 * m + 0.2 * g, 0.98 * v + 0.02 * g * g
      step = m / (1 - 0.8 ** t) / (np.sqrt(v / (1 - 0.98 ** t)) + 1e-3)
      expected = expected - 0.01 * (step + 0.1 * expected)
    np.testing.assert_allclose(np.asarray(params), expected, rtol=1e-5)


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('b2_one', dict(b2=1.0), 'optimizer.b2=1.0'),
      ('b1_negative', dict(b1=-0.1), 'optimizer.b1=-0.1'),
      ('eps_zero', dict(eps=0.0), 'optimizer.eps=0.0'),
      ('rsqrt_without_warmup', dict(lr_schedule='rsqrt', warmup_steps=0), 'optimizer.warmup_steps=0'),
      ('unknown_lr_schedule', dict(lr_schedule='linear'), 'rsqrt'))
  def test_bad_fields_are_named(self, fields, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      validation.validate(_optimizer_config(**fields))


if __name__ == '__main__':
  jax.config.update('jax_platforms', 'cpu')
  absltest.main()
