"""MNIST-1D: generated locally (never downloaded), the paper's split, deterministic, cached on disk."""

import os
import random
from unittest import mock

from absl.testing import absltest
import mnist1d.data
import numpy as np
import requests

from waitless.data import mnist1d as mnist1d_lib
from waitless.experiments.configs import mnist1d as mnist1d_config


def _no_network(*args, **kwargs):
  raise AssertionError(f'network access: {args} {kwargs}')


class Mnist1dTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cache = self.create_tempdir().full_path
    self.enter_context(mock.patch.dict(os.environ, {mnist1d_lib.CACHE_ENV: self.cache}))
    # The package's download path and any HTTP request fail the test.
    self.enter_context(mock.patch.object(mnist1d.data, 'get_dataset', _no_network))
    self.enter_context(mock.patch.object(requests, 'get', _no_network))
    self.enter_context(mock.patch.object(requests.Session, 'request', _no_network))
    mnist1d_lib._cached.cache_clear()
    self.addCleanup(mnist1d_lib._cached.cache_clear)

  def test_split_shapes_and_classes(self):
    train, test = mnist1d_lib.load_arrays()
    self.assertEqual(train['image'].shape, (4000, 40))
    self.assertEqual(test['image'].shape, (1000, 40))
    self.assertEqual(train['image'].dtype, np.float32)
    self.assertEqual(train['label'].dtype, np.int32)
    self.assertEqual(test['label'].shape, (1000,))
    # 500 sequences per class over both splits; standardised by the package.
    counts = np.bincount(np.concatenate([train['label'], test['label']]), minlength=10)
    np.testing.assert_array_equal(counts, np.full(10, 500))
    both = np.concatenate([train['image'], test['image']])
    self.assertAlmostEqual(float(both.mean()), 0.0, places=4)
    self.assertAlmostEqual(float(both.std()), 1.0, places=4)
    self.assertFalse(np.array_equal(train['image'][0], train['image'][1]))

  def test_generation_is_deterministic_and_leaves_global_rng_alone(self):
    np.random.seed(123)
    random.seed(123)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    first = mnist1d_lib.generate()
    np.testing.assert_array_equal(np.random.get_state()[1], np_before)
    self.assertEqual(random.getstate(), py_before)
    second = mnist1d_lib.generate()
    for key in ('x_train', 'y_train', 'x_test', 'y_test'):
      np.testing.assert_array_equal(first[key], second[key], err_msg=key)

  def test_cache_is_written_once_and_read_back_without_generating(self):
    train, test = mnist1d_lib.load_arrays()
    files = os.listdir(self.cache)
    self.assertLen(files, 1)
    self.assertEqual(files, ['mnist1d-0.0.2.post1.npz'])  # the pinned version
    mnist1d_lib._cached.cache_clear()
    with mock.patch.object(mnist1d_lib, 'generate', side_effect=AssertionError('regenerated')):
      again_train, again_test = mnist1d_lib.load_arrays()
    np.testing.assert_array_equal(again_train['image'], train['image'])
    np.testing.assert_array_equal(again_test['label'], test['label'])

  def test_unreadable_cache_is_regenerated(self):
    train, _ = mnist1d_lib.load_arrays()
    path = os.path.join(self.cache, os.listdir(self.cache)[0])
    with open(path, 'wb') as f:
      f.write(b'truncated')
    mnist1d_lib._cached.cache_clear()
    again, _ = mnist1d_lib.load_arrays()
    np.testing.assert_array_equal(again['image'], train['image'])
    with np.load(path) as f:  # replaced by a whole file
      np.testing.assert_array_equal(f['y_train'], train['label'])

  def test_dataset_streams_and_eval_split(self):
    config = mnist1d_config.get_config('sync')
    dataset = mnist1d_lib.make_dataset(config)
    self.assertEqual((dataset.num_classes, dataset.train_size), (10, 4000))
    batch = dataset.train.read(np.arange(8), np.zeros((2, 8), np.int64), 1)
    self.assertEqual(batch['image'].shape, (2, 8, 1, config.batch_size, 40))
    eval_batches = list(dataset.eval_batches(512))
    self.assertLen(eval_batches, 2)
    self.assertEqual(sum(b['mask'].sum() for b in eval_batches), 1000)


if __name__ == '__main__':
  absltest.main()
