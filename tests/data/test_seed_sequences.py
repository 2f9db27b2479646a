"""numpy's SeedSequence, vectorised: the same states and the same streams as numpy's, seed by seed."""

from absl.testing import absltest
import numpy as np

from waitless.data import seed_sequences


class SeedSequencesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    words = np.random.default_rng(0).integers(0, 2**32, size=(300, 4), dtype=np.uint64).astype(np.uint32)
    edges = [[0, 0, 0, 0], [0, 2, 0, 0], [1, 2, 3, 4], [2**32 - 1] * 4, [7, 2, 5, 2**31]]
    self.words = np.concatenate([np.array(edges, np.uint32), words])

  def test_states_are_numpys_seed_sequence_states(self):
    expected = np.stack([np.random.SeedSequence(row).generate_state(4, np.uint64) for row in self.words])
    got = seed_sequences.states(self.words)
    self.assertEqual(got.dtype, np.uint64)
    np.testing.assert_array_equal(got, expected)

  def test_generators_draw_default_rngs_streams(self):
    for rng, row in zip(seed_sequences.generators(self.words[:40]), self.words[:40]):
      # numpy's own generator of the same words, given as an array and as a list of ints (what the data
      # streams seeded with before): the same draws, in turn.
      for reference in (np.random.default_rng(row), np.random.default_rng([int(w) for w in row])):
        ours = np.random.Generator(np.random.PCG64(seed_sequences._State(seed_sequences.states(row[None])[0])))
        np.testing.assert_array_equal(ours.permutation(179), reference.permutation(179))
        np.testing.assert_array_equal(ours.integers(0, 2**62, size=5), reference.integers(0, 2**62, size=5))
        self.assertEqual(ours.random(), reference.random())
      np.testing.assert_array_equal(rng.permutation(179), np.random.default_rng(row).permutation(179))

  def test_one_seed_and_none(self):
    np.testing.assert_array_equal(seed_sequences.states(self.words[:1]),
                                  np.random.SeedSequence(self.words[0]).generate_state(4, np.uint64)[None])
    self.assertEqual(seed_sequences.states(np.zeros((0, 4), np.uint32)).shape, (0, 4))

  def test_other_shapes_are_refused(self):
    with self.assertRaisesRegex(ValueError, r'entropy must be \(K, 4\) uint32 words, got shape \(3,\)'):
      seed_sequences.states(np.zeros(3, np.uint32))
    with self.assertRaisesRegex(ValueError, 'precomputed for 4 uint64 words, asked for 2 uint32'):
      seed_sequences._State(np.zeros(4, np.uint64)).generate_state(2, np.uint32)


if __name__ == '__main__':
  absltest.main()
