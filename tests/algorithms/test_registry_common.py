"""Every registered algorithm, through the real harness: jit-able, finite, shapes and dtypes kept, and its
state survives an orbax checkpoint round trip. New algorithms join this test by being registered."""

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.cluster.rules import base as rules_base
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import validation
from tests import harness


def _config(name):
  # 4 workers on 2 devices (vmapped workers), 2 micro-batches: the general layout.
  return harness.synthetic_config(name, workers=4, devices=2, microbatches=2)


class RegistryCommonTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in registry.names()])
  def test_runs_finite_and_keeps_shapes(self, name):
    traj = harness.run_iterations(_config(name), 4, block=2)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), traj.initial_params)
    after = jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), traj.params[-1])
    self.assertEqual(before, after)
    for leaf in jax.tree.leaves(traj.params[-1]) + jax.tree.leaves(jax.device_get(traj.final_state.opt_state)):
      self.assertTrue(np.all(np.isfinite(np.asarray(leaf, np.float64))), name)
    self.assertTrue(np.all(np.isfinite(traj.losses)))
    changed = any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0
                  for a, b in zip(jax.tree.leaves(traj.initial_params), jax.tree.leaves(traj.params[-1])))
    self.assertTrue(changed, f'{name} did not move the parameters')

  @parameterized.named_parameters(*[(name, name) for name in registry.names()])
  def test_state_survives_a_checkpoint_round_trip(self, name):
    traj = harness.run_iterations(_config(name), 2, block=2)
    state = traj.final_state
    with tempfile.TemporaryDirectory() as tmp:
      ckpt = checkpointing.Checkpointer(tmp)
      ckpt.save(2, state, {'step': 2})
      ckpt.wait()
      restored, meta = ckpt.restore(2, state)
      ckpt.close()
    self.assertEqual(meta, {'step': 2})
    self.assertEqual(jax.tree.structure(restored), jax.tree.structure(state))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
      self.assertEqual(a.sharding, b.sharding)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  @parameterized.named_parameters(*[(name, name) for name in registry.names()])
  def test_spec_is_complete(self, name):
    spec = registry.get(name)
    self.assertEqual(spec.name, name)
    config = _config(name)
    validation.validate(config)  # its defaults form a valid config
    self.assertEqual(set(config.algorithm.keys()) - {'name'}, set(spec.defaults))
    self.assertIsInstance(registry.time_rule(config), rules_base.TimeRule)

  def test_unknown_name_lists_the_known_ones(self):
    with self.assertRaisesRegex(errors.ConfigError, 'algorithm.name.*' + '.*'.join(registry.names())):
      registry.get('nope')
    config = _config('sync')
    config.algorithm.name = 'nope'
    with self.assertRaisesRegex(errors.ConfigError, 'algorithm.name.*' + '.*'.join(registry.names())):
      registry.time_rule(config)


if __name__ == '__main__':
  absltest.main()
