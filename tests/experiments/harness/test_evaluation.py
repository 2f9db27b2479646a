"""A group's evaluation (`evaluation.make_evaluator`): vectorised over the replicas unless XLA:CPU would group
the model's convolutions, and each replica's figures those of its run alone."""

from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

from waitless.experiments.configs import cifar10
from waitless.experiments.configs import mnist1d
from waitless.experiments.harness import evaluation
from waitless.experiments.harness import setup
from waitless.experiments.harness import xla_cpu


def _mnist1d(seed: int):
  config = mnist1d.get_config('local_sgd,workers=4,devices=2')
  config.seed = seed
  return config


def _one_replica(group: setup.Group):
  """(eval sums of one replica on the first eval batch, the group's consensus params and model state (R, ...))."""
  run = group.lead
  params, model_state, _ = evaluation.make_evaluator(group).consensus(setup.init_state(group))
  batch = next(iter(run.dataset.eval_batches(run.config.eval_batch_size)))
  return (lambda p, m: run.task.eval_sums(run.model, p, m, batch)), params, model_state


class EvaluationTest(absltest.TestCase):

  def test_a_convolution_is_found_inside_a_jit_inside_a_cond(self):
    def conv(x, w):
      return lax.conv_general_dilated(x, w, (1,), 'SAME')

    def nested(x, w):
      return lax.cond(x.sum() > 0, jax.jit(conv), lambda x, w: x * 0.0, x, w)
    x, w = jnp.ones((1, 1, 8)), jnp.ones((1, 1, 3))
    self.assertTrue(xla_cpu._has_convolution(jax.make_jaxpr(nested)(x, w).jaxpr))
    self.assertFalse(xla_cpu._has_convolution(jax.make_jaxpr(lambda a: a @ a.T)(jnp.ones((2, 3))).jaxpr))

  def test_on_cpu_matrix_products_vectorise_and_convolutions_do_not(self):
    group = setup.build_group([_mnist1d(0), _mnist1d(1)])  # MNIST-1D's CNN: convolutions as matrix products
    layout = group.lead.layout
    self.assertEqual(layout.platform, 'cpu')
    self.assertTrue(xla_cpu.vectorize_replicas(layout.platform, *_one_replica(group)))
    configs = [cifar10.get_config(f'local_sgd,model.name=resnet_test,workers=2,devices=2,batch_size=4,seed={s}')
               for s in (0, 1)]
    with tfds.testing.mock_data(num_examples=16):
      resnet = setup.build_group(configs)
      self.assertFalse(xla_cpu.vectorize_replicas(resnet.lead.layout.platform, *_one_replica(resnet)))
      self.assertTrue(xla_cpu.vectorize_replicas('gpu', *_one_replica(resnet)))

  def test_each_replica_evaluates_as_its_run_alone(self):
    configs = [_mnist1d(0), _mnist1d(1)]
    group = setup.build_group(configs)
    together = evaluation.make_evaluator(group)(setup.init_state(group))
    for config, figures in zip(configs, together):
      run = setup.build_group([config])
      alone = evaluation.make_evaluator(run)(setup.init_state(run))
      self.assertEqual(figures.keys(), alone.keys())
      for key, value in alone.items():  # float32 sums in another order: equal to rounding
        np.testing.assert_allclose(figures[key], value, rtol=1e-5, err_msg=key)


if __name__ == '__main__':
  absltest.main()
