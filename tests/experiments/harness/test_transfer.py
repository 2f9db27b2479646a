"""The harness's own transfers (`transfer.put`, `transfer.fetch`) against JAX's public ones: the same arrays,
and the fast path present in the pinned JAX (a version without it falls back, slower, and this test says so)."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from waitless.experiments.harness import transfer


def _mesh():
  return Mesh(np.array(jax.devices()[:8]), ('workers',))


SPECS = {'workers_second': PartitionSpec(None, 'workers'), 'workers_first': PartitionSpec('workers'),
         'replicated': PartitionSpec()}


class TransferTest(parameterized.TestCase):

  def test_the_pinned_jax_has_the_fast_path(self):
    self.assertTrue(callable(transfer._BATCHED_DEVICE_PUT))

  @parameterized.product(spec=tuple(SPECS), dtype=(np.int32, np.float32, np.int64, np.bool_))
  def test_put_gives_what_device_put_gives(self, spec, dtype):
    sharding = NamedSharding(_mesh(), SPECS[spec])
    host = (np.random.default_rng(0).integers(0, 100, (8, 8, 5)) % (2 if dtype == np.bool_ else 100)).astype(dtype)
    want = jax.device_put(host, sharding)
    for got in (transfer.put(host, sharding), self._without_fast_path(host, sharding)):
      self.assertEqual(got.sharding, want.sharding)
      self.assertEqual(got.dtype, want.dtype)
      for a, b in zip(got.addressable_shards, want.addressable_shards):
        self.assertEqual(a.device, b.device)
        self.assertEqual(a.index, b.index)
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))

  def _without_fast_path(self, host, sharding):
    with mock.patch.object(transfer, '_BATCHED_DEVICE_PUT', None):
      return transfer.put(host, sharding)

  @parameterized.product(spec=tuple(SPECS), permuted=(False, True))
  def test_fetch_gives_what_asarray_gives(self, spec, permuted):
    host = np.random.default_rng(1).normal(size=(8, 8, 3)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:8])[::-1 if permuted else 1], ('workers',))
    array = jax.jit(lambda x: x * 2.0)(jax.device_put(host, NamedSharding(mesh, SPECS[spec])))
    got = transfer.fetch(array)
    self.assertIsInstance(got, np.ndarray)
    np.testing.assert_array_equal(got, np.asarray(array))
    np.testing.assert_array_equal(transfer.fetch(jax.device_put(host, jax.devices()[3])), host)
    np.testing.assert_array_equal(transfer.fetch(host), host)


if __name__ == '__main__':
  absltest.main()
