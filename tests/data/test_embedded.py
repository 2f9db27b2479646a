"""The embedded data sets: fixed split, disjoint per-worker shards, order a function of the seed only."""

import subprocess
import sys

from absl.testing import absltest
import numpy as np

from waitless import config_errors as errors
from waitless.data import digits
from waitless.data import in_memory
from waitless.data import synthetic
from waitless.experiments.configs import digits as digits_config


class EmbeddedDataTest(absltest.TestCase):

  def test_digits_split_is_fixed_and_normalised(self):
    train, test = digits.load_arrays()
    again_train, again_test = digits.load_arrays()
    np.testing.assert_array_equal(test['label'], again_test['label'])
    self.assertEqual(len(train['label']) + len(test['label']), 1797)
    self.assertEqual(train['image'].shape[1], 64)
    np.testing.assert_allclose(train['image'].mean(0), 0.0, atol=1e-5)
    self.assertLess(np.abs(test['image']).max(), 50)

  def test_digits_are_scikit_learns_split_without_importing_it(self):
    for fraction in (0.2, 0.1, 0.37, 0.5):  # 0.2: the config's; others: ties broken by the seeded draws
      train, test = digits.load_arrays(fraction)
      from sklearn import datasets as sk_datasets
      from sklearn import model_selection
      loaded = sk_datasets.load_digits()
      x, y = loaded.data.astype(np.float32) / 16.0, loaded.target.astype(np.int32)
      x_train, x_test, y_train, y_test = model_selection.train_test_split(
          x, y, test_size=fraction, random_state=digits.SPLIT_SEED, stratify=y)
      mean, std = x_train.mean(axis=0), np.maximum(x_train.std(axis=0), 0.1)
      for got, want in ((train['image'], (x_train - mean) / std), (test['image'], (x_test - mean) / std),
                        (train['label'], y_train), (test['label'], y_test)):
        self.assertEqual(got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)

  def test_digits_load_imports_no_scikit_learn(self):
    code = ('import sys; from waitless.data import digits; digits.load_arrays(); '
            'print(sorted(m for m in sys.modules if m.split(".")[0] in ("sklearn", "scipy")))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    self.assertEqual(out.stdout.strip(), '[]')

  def test_workers_read_disjoint_shards_in_each_epoch(self):
    n, workers, mb = 103, 4, 5
    streams = in_memory.InMemoryStreams({'id': np.arange(n)}, workers=workers, microbatch_size=mb, seed=3)
    per_epoch = streams.shard_size // mb
    ids = streams.read(np.arange(workers), np.zeros((1, workers), np.int64), per_epoch)['id'][0]
    seen = [set(ids[w].ravel()) for w in range(workers)]
    for a in range(workers):
      for b in range(a + 1, workers):
        self.assertEmpty(seen[a] & seen[b])
    # An epoch visits the worker's shard once, the next epoch the same shard in another order.
    second = streams.read(np.arange(workers), np.full((1, workers), per_epoch), per_epoch)['id'][0]
    for w in range(workers):
      self.assertEqual(set(second[w].ravel()), seen[w])
      self.assertFalse(np.array_equal(second[w], ids[w]))

  def test_same_positions_same_samples_and_seed_changes_the_order(self):
    arrays = {'id': np.arange(200)}
    a = in_memory.InMemoryStreams(arrays, workers=2, microbatch_size=4, seed=0)
    b = in_memory.InMemoryStreams(arrays, workers=2, microbatch_size=4, seed=0)
    c = in_memory.InMemoryStreams(arrays, workers=2, microbatch_size=4, seed=1)
    positions = np.array([[0, 7], [3, 30]])
    np.testing.assert_array_equal(a.read([0, 1], positions, 2)['id'], b.read([0, 1], positions, 2)['id'])
    # Random access: reading a position later, or alone, gives the same micro-batch.
    np.testing.assert_array_equal(a.read([1], [[30]], 1)['id'][0, 0, 0], b.read([0, 1], positions, 2)['id'][1, 1, 0])
    self.assertFalse(np.array_equal(a.read([0, 1], positions, 2)['id'], c.read([0, 1], positions, 2)['id']))

  def test_a_read_over_many_epochs_equals_its_rows_read_one_at_a_time(self):
    # The training loop reads several blocks at once: rows in several epochs, workers epochs apart.
    arrays = {'id': np.arange(90)}
    spanning = in_memory.InMemoryStreams(arrays, workers=3, microbatch_size=4, seed=5)
    rows = in_memory.InMemoryStreams(arrays, workers=3, microbatch_size=4, seed=5)
    positions = np.array([[0, 2, 40], [5, 3, 41], [9, 11, 43], [14, 11, 50]])  # 30 per shard: epochs 0-2 and 5-7
    got = spanning.read([0, 1, 2], positions, 3)['id']
    for n, row in enumerate(positions):
      np.testing.assert_array_equal(got[n], rows.read([0, 1, 2], row[None], 3)['id'][0])

  def test_epoch_orders_are_the_generators_seeded_by_the_list_of_words(self):
    arrays = {'id': np.arange(60)}
    epochs = [0, 7, 123456, 2**32 - 1, 2**32]  # the last one past 32 bits: numpy's own seeding, as a seed there
    for seed in (0, 17, 2**32 - 1, 2**32 + 3, 2**40):
      streams = in_memory.InMemoryStreams(arrays, workers=2, microbatch_size=2, seed=seed)
      for together in (epochs[:-1], epochs):  # made in one call, the generators seeded at once
        tables = streams._epoch_orders(together)
        for e, epoch in enumerate(together):
          for worker in (0, 1):
            permutation = np.random.default_rng([seed, 2, worker, epoch]).permutation(streams.shard_size)
            np.testing.assert_array_equal(tables[e, worker], streams._shards[worker][permutation])

  def test_more_workers_than_the_data_feeds_is_a_config_error_naming_workers(self):
    with self.assertRaisesRegex(errors.ConfigError, r'^workers=100 is not allowed: 200 training examples over '
                                r'100 workers leave 2 per worker, fewer than one micro-batch of 4'):
      in_memory.InMemoryStreams({'id': np.arange(200)}, workers=100, microbatch_size=4, seed=0)

  def test_dataset_builders(self):
    config = digits_config.get_config('sync')
    dataset = digits.make_dataset(config)
    self.assertEqual(dataset.num_classes, 10)
    batch = dataset.train.read(np.arange(8), np.zeros((2, 8), np.int64), 1)
    self.assertEqual(batch['image'].shape, (2, 8, 1, 16, 64))
    eval_batches = list(dataset.eval_batches(100))
    self.assertEqual(sum(b['mask'].sum() for b in eval_batches), 360)
    train, test = synthetic.make_arrays('least_squares', 100, 4, 0.0, seed=0)
    self.assertEqual(train['image'].shape, (80, 4))
    self.assertEqual(test['label'].shape, (20,))


if __name__ == '__main__':
  absltest.main()
