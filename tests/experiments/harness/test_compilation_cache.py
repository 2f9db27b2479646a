"""The persistent compilation cache for a block only: programs compiled after it are not written there."""

import os
import tempfile
import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp

from waitless.experiments.harness import compilation_cache


class EnabledTest(absltest.TestCase):

  def test_programs_after_the_block_are_not_written_to_its_directory(self):
    # Every program would be cached (no minimum compile time or size) if a cache were still open.
    for name in compilation_cache.SETTINGS[1:]:
      previous = getattr(jax.config, name)
      jax.config.update(name, 0)
      self.addCleanup(jax.config.update, name, previous)
    with tempfile.TemporaryDirectory() as kept:
      with compilation_cache.enabled(kept):
        jax.jit(lambda x: x + 11.0)(jnp.ones(3)).block_until_ready()
      written = set(os.listdir(kept))
      self.assertNotEmpty(written)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        jax.jit(lambda x: x * 13.0)(jnp.ones(3)).block_until_ready()
      self.assertEqual(set(os.listdir(kept)), written)
      self.assertEmpty([w for w in caught if 'compilation cache' in str(w.message)])


if __name__ == '__main__':
  absltest.main()
