"""The activation broadcast's hop counts: only the rows a rule needs, never a dense P x P table (issue 59)."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import activation


def _dense_hops(workers):
  """The (P, P) popcount(i XOR k) table the rules used to build (8.6 GB of int64 temporaries at P = 32,768)."""
  index = np.arange(workers)
  return np.array([[bin(i ^ k).count('1') for k in index] for i in index])


class HopsTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 5, 8, 13, 16, 33)
  def test_rows_and_eccentricity_equal_the_dense_table(self, workers):
    dense = _dense_hops(workers)
    np.testing.assert_array_equal(activation.hops_from(np.arange(workers), workers), dense)
    np.testing.assert_array_equal(activation.hops_from(3 % workers, workers), dense[3 % workers])
    np.testing.assert_array_equal(activation.eccentricity(workers), dense.max(axis=1))
    spread = 0b101
    masked = np.array([[bin((i ^ k) & ~spread).count('1') for k in range(workers)] for i in range(workers)])
    np.testing.assert_array_equal(activation.hops_from(np.arange(workers), workers, ignore=spread), masked)

  def test_a_million_workers_needs_no_p_by_p_table(self):
    p = 1 << 20  # a dense table: 8 TiB of int64, numpy refused it with a traceback
    self.assertEqual(activation.hops_from(5, p).shape, (p,))
    self.assertEqual(int(activation.eccentricity(p).max()), 20)


if __name__ == '__main__':
  absltest.main()
