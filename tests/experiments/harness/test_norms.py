"""The step's measured norms: over the leaves one by one (`step.tree_l2`), or concatenated (`xla_cpu.flat_l2`,
on CPU)."""

from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import block_program
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import xla_cpu
from tests import harness


class TreeL2Test(absltest.TestCase):

  def test_flat_and_per_leaf_norms_are_the_norm(self):
    rng = np.random.default_rng(0)
    tree = {'w': rng.normal(size=(64, 128)).astype(np.float32), 'b': rng.normal(size=(10,)).astype(np.float32),
            'half': jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16), 'scalar': np.float32(2.5)}
    exact = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))
    for norm in (step_lib.tree_l2, xla_cpu.flat_l2):
      got = norm(tree)
      self.assertEqual(got.dtype, jnp.float32)
      np.testing.assert_allclose(float(got), exact, rtol=1e-6)
      self.assertEqual(float(norm({})), 0.0)
      self.assertEqual(float(norm({'x': np.float32([3.0, 4.0])})), 5.0)


class FlatNormsInTheStepTest(absltest.TestCase):
  """The block step with flat norms: the same state to the bit (the norms are measurements only), the same
  measurements up to float32 rounding, and the programs that run on this CPU."""

  def test_same_state_and_close_norms(self):
    for arg, workers, devices in (('sync', 4, 4), ('local_sgd', 4, 2), ('kasync,k=2', 4, 1)):
      config = harness.synthetic_config(arg, workers=workers, devices=devices, microbatches=2)
      run = setup.build(config)
      inputs, _ = inputs_lib.block_inputs(run, setup.clock_for(run, 1e4).next_block(6),
                                          np.zeros(config.workers, np.int64), 0)
      flat_state, flat_measured = block_step_lib.BlockStep(run)(setup.init_state(run), *inputs)
      with mock.patch.object(xla_cpu, 'norm', lambda platform: step_lib.tree_l2):
        leaf_state, leaf_measured = block_step_lib.BlockStep(run)(setup.init_state(run), *inputs)
      jax.tree.map(np.testing.assert_array_equal, flat_state, leaf_state)
      flat, leaf = (block_program.unpack_measurements(np.asarray(m)) for m in (flat_measured, leaf_measured))
      np.testing.assert_array_equal(flat['loss'], leaf['loss'])
      for key in ('l2_grads', 'l2_params'):
        self.assertGreater(float(np.max(leaf[key])), 0.0, key)  # measured, not all zero
        np.testing.assert_allclose(flat[key], leaf[key], rtol=1e-6, err_msg=f'{arg}: {key}')
      self.assertIs(xla_cpu.norm(run.layout.platform), xla_cpu.flat_l2)  # on this CPU


if __name__ == '__main__':
  absltest.main()
