"""Paper models: parameter counts against the published ones (shapes only, no real init), tiny variants run."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.models import registry
from waitless.models import resnet
from waitless.models import transformer
from waitless.models import wrn


def _param_count(model, inputs) -> int:
  shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), inputs)
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes['params']))


def _images(size, batch=1):
  return jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)


def _tokens(length=16):
  return {'inputs': jax.ShapeDtypeStruct((1, length), jnp.int32),
          'targets': jax.ShapeDtypeStruct((1, length), jnp.int32)}


def _config(name, **fields):
  return ml_collections.ConfigDict({'name': name, 'dtype': 'float32', 'param_dtype': 'float32', **fields})


class ParamCountTest(parameterized.TestCase):
  """Published sizes: He et al. 2016 (ResNet-20 0.27M, ResNet-56 0.85M, ResNet-50 25.6M), Zagoruyko &
  Komodakis 2016 (WRN-16-8 11.0M), Vaswani et al. 2017 (Transformer base ~61-65M, by vocabulary)."""

  @parameterized.named_parameters(
      ('resnet20', resnet.ResNet20, 10, 32, 0.27e6, 0.02),
      ('resnet56', resnet.ResNet56, 10, 32, 0.85e6, 0.02),
      ('resnet18_cifar', resnet.ResNet18, 10, 32, 11.17e6, 0.01),
      ('resnet50', resnet.ResNet50, 1000, 224, 25.56e6, 0.01),
      ('wrn16_8', wrn.WRN16_8, 10, 32, 11.0e6, 0.01),
      ('wrn28_10', wrn.WRN28_10, 10, 32, 36.5e6, 0.01),
  )
  def test_image_models(self, cls, classes, size, published, rtol):
    count = _param_count(cls(num_classes=classes), _images(size))
    self.assertBetween(count, published * (1 - rtol), published * (1 + rtol))

  def test_resnet20_option_a_has_no_shortcut_parameters_and_option_b_has(self):
    self.assertEqual(_param_count(resnet.ResNet20(num_classes=10), _images(32)), 269_722)
    self.assertGreater(_param_count(resnet.ResNet20(num_classes=10, shortcut='B'), _images(32)), 269_722)

  @parameterized.parameters((32_000, 60.0e6, 61.0e6), (37_000, 62.5e6, 63.5e6))
  def test_transformer_base(self, vocab, low, high):
    model = transformer.Transformer(transformer.TransformerConfig(vocab_size=vocab))
    self.assertBetween(_param_count(model, _tokens()), low, high)


class TinyModelTest(parameterized.TestCase):

  @parameterized.parameters('resnet_test', 'resnet50_test', 'wrn_test')
  def test_image_model_trains_batch_stats_and_keeps_dtypes(self, name):
    model = registry.make_model(_config(name), 7)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 16, 3)), jnp.float32)
    variables = model.init(jax.random.key(0), x, train=False)
    logits, state = model.apply(variables, x, train=True, mutable=['batch_stats'])
    eval_logits = model.apply(variables, x, train=False)
    self.assertEqual(logits.shape, (2, 7))
    self.assertEqual(eval_logits.shape, (2, 7))
    self.assertTrue(np.all(np.isfinite(logits)))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), variables['batch_stats'], state['batch_stats'])
    self.assertTrue(any(jax.tree.leaves(changed)))

  def test_bfloat16_compute_with_float32_parameters(self):
    model = registry.make_model(_config('resnet_test', dtype='bfloat16'), 7)
    x = jnp.ones((2, 8, 8, 3), jnp.float32)
    variables = model.init(jax.random.key(0), x, train=False)
    out = model.apply(variables, x, train=True, mutable=['batch_stats'])[0]
    self.assertTrue(all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(variables['params'])))
    self.assertEqual(out.dtype, jnp.bfloat16)

  def test_registry_builds_every_paper_model_lazily(self):
    for name in ('resnet20', 'resnet56', 'resnet18', 'resnet50', 'wrn16_8', 'wrn28_10', 'transformer_base',
                 'transformer_big'):
      self.assertIsNotNone(registry.make_model(_config(name), 10))

  def test_config_overrides_preset_fields(self):
    self.assertEqual(registry.make_model(_config('resnet20', shortcut='B'), 10).shortcut, 'B')
    self.assertEqual(registry.make_model(_config('wrn16_8', dropout_rate=0.3), 10).dropout_rate, 0.3)
    model = registry.make_model(_config('transformer_test', max_len=64, dropout_rate=0.0), 50)
    self.assertEqual((model.config.max_len, model.config.dropout_rate, model.config.vocab_size), (64, 0.0, 50))

  def test_unknown_dtype_is_a_config_error(self):
    with self.assertRaisesRegex(errors.ConfigError, 'model.dtype'):
      registry.make_model(_config('resnet20', dtype='float8'), 10)

  def test_wrn_dropout_uses_the_dropout_rng(self):
    model = wrn.WideResNet(depth=10, width=1, base_filters=4, dropout_rate=0.5, num_classes=3)
    x = jnp.ones((2, 8, 8, 3))
    variables = model.init(jax.random.key(0), x, train=False)
    run = lambda k: model.apply(variables, x, train=True, mutable=['batch_stats'], rngs={'dropout': k})[0]
    np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
    self.assertFalse(np.allclose(run(jax.random.key(1)), run(jax.random.key(2))))


class StridedConv1DTest(parameterized.TestCase):

  @parameterized.parameters((5, 2, (1, 1), 40), (3, 2, (1, 1), 19), (3, 1, (0, 2), 7))
  def test_equals_flax_conv_with_the_same_parameters(self, k, stride, padding, length):
    from waitless.models import cnn1d
    with jax.enable_x64(True):
      x = jax.random.normal(jax.random.key(1), (3, length, 4), jnp.float64)
      ours = cnn1d.StridedConv1D(6, k, stride, padding, dtype=jnp.float64, param_dtype=jnp.float64)
      flax_conv = nn.Conv(6, (k,), strides=(stride,), padding=[padding], dtype=jnp.float64, param_dtype=jnp.float64)
      params = ours.init(jax.random.key(0), x)
      reference = flax_conv.init(jax.random.key(0), x)
      jax.tree.map(np.testing.assert_array_equal, params, reference)  # same names, shapes and initial values
      params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape, p.dtype), params)
      np.testing.assert_allclose(ours.apply(params, x), flax_conv.apply(params, x), rtol=1e-12, atol=1e-12)

  def test_the_cnn_keeps_the_parameter_tree_of_flax_convolutions(self):
    from waitless.models import cnn1d
    shapes = jax.eval_shape(lambda: cnn1d.CNN1D().init(jax.random.key(0), jnp.zeros((1, 40))))['params']
    self.assertEqual(sorted(shapes), ['Conv_0', 'Conv_1', 'Conv_2', 'Dense_0'])
    self.assertEqual(shapes['Conv_0']['kernel'].shape, (5, 1, 25))
    self.assertEqual(sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes)), 5210)


if __name__ == '__main__':
  absltest.main()
