"""The initial state: the model's initialisation, compiled at XLA:CPU's -O1 (`compilation_cache.
quick_compile_options`), gives bit for bit the parameters of `model.init` compiled with the defaults, on every
worker and every replica."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.experiments.configs import digits
from waitless.experiments.configs import mnist1d
from waitless.experiments.harness import setup


def _default_init(run, seed):
  """`model.init` as every run computed it before the -O1 compile: jitted with the default options."""
  example = jax.tree.map(lambda x: np.asarray(x)[None], run.dataset.example)
  init = jax.jit(lambda key, inputs: run.model.init(key, inputs, train=False))
  return jax.device_get(init(jax.random.key(seed), run.task.model_inputs(example)))


def _assert_bits_equal(test, got, want):
  test.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    test.assertEqual(a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


class InitialStateTest(parameterized.TestCase):

  @parameterized.named_parameters(('digits_mlp', digits, 'sync'), ('mnist1d_cnn', mnist1d, 'sync'))
  def test_parameters_equal_the_default_compiles_on_every_worker(self, workload, arg):
    for seed in (0, 1, 12345):
      config = workload.get_config(arg)
      config.seed = seed
      run = setup.build(config)
      self.assertEqual(run.layout.mesh.devices.flat[0].platform, 'cpu')  # the -O1 path is under test
      state = jax.device_get(setup.init_state(run))
      want = _default_init(run, seed)
      for worker in range(config.workers):
        _assert_bits_equal(self, jax.tree.map(lambda x, w=worker: x[w], state.params), want['params'])

  def test_replicas_equal_their_runs_alone(self):
    configs = []
    for seed in (3, 4):
      config = digits.get_config('sync')
      config.seed = seed
      configs.append(config)
    group = setup.build_group(configs)
    state = jax.device_get(setup.init_state(group))
    for r, config in enumerate(configs):
      want = _default_init(group.runs[r], config.seed)
      _assert_bits_equal(self, jax.tree.map(lambda x, r=r: x[r, 0], state.params), want['params'])


if __name__ == '__main__':
  absltest.main()
