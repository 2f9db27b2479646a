"""tfds image pipelines (CIFAR, ImageNet) under tfds mock data: shards, positions, resume, eval, missing data."""

import hashlib

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from waitless import config_errors as errors
from waitless.data import cifar  # noqa: F401  registers its loader
from waitless.data import imagenet  # noqa: F401  registers its loader
from waitless.data import registry
from waitless.data import tfds_pipeline

EXAMPLES = 48  # mock examples per split


def _config(name='cifar10', workers=4, batch_size=4, microbatches=2, seed=0, **dataset):
  d = {'name': name, 'data_dir': None, 'shuffle_buffer': 16, 'augment': True, 'image_size': 24, **dataset}
  return ml_collections.ConfigDict({'workers': workers, 'batch_size': batch_size, 'microbatches': microbatches,
                                    'seed': seed, 'dataset': d})


def _fingerprints(images):
  """One hash per image of a (..., H, W, C) array."""
  flat = images.reshape((-1,) + images.shape[-3:])
  return [hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest() for x in flat]


class ImagePipelineTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(tfds.testing.mock_data(num_examples=EXAMPLES))

  @parameterized.parameters(('cifar10', 10, 32), ('cifar100', 100, 32), ('imagenet2012', 1000, 24))
  def test_shapes_dtypes_and_dataset_fields(self, name, classes, size):
    ds = registry.make_dataset(_config(name))
    batch = ds.train.read(np.array([0, 2]), np.array([[0, 3], [1, 4]]), 2)
    self.assertEqual(batch['image'].shape, (2, 2, 2, 2, size, size, 3))
    self.assertEqual(batch['image'].dtype, np.float32)
    self.assertEqual(batch['label'].shape, (2, 2, 2, 2))
    self.assertEqual(batch['label'].dtype, np.int32)
    self.assertTrue(np.all((batch['label'] >= 0) & (batch['label'] < classes)))
    self.assertEqual((ds.num_classes, ds.train_size, ds.task), (classes, EXAMPLES, 'classification'))
    self.assertEqual(ds.example['image'].shape, (size, size, 3))

  @parameterized.parameters('cifar10', 'imagenet2012')
  def test_workers_get_disjoint_shards_and_each_epoch_covers_its_shard(self, name):
    ds = registry.make_dataset(_config(name, augment=False))
    shard = ds.train.shard_size
    self.assertEqual(shard, EXAMPLES // 4)
    per_epoch = shard // 2  # micro-batches of 2
    seen = []
    for worker in range(4):
      epoch0 = ds.train.read(np.array([worker]), np.array([[0]]), per_epoch)['image']
      epoch1 = ds.train.read(np.array([worker]), np.array([[per_epoch]]), per_epoch)['image']
      a, b = _fingerprints(epoch0), _fingerprints(epoch1)
      self.assertLen(set(a), shard)
      self.assertEqual(set(a), set(b))      # the same examples ...
      self.assertNotEqual(a, b)             # ... in a new order
      seen.append(set(a))
    self.assertLen(set.union(*seen), 4 * shard)

  def test_same_positions_give_the_same_samples_in_any_order_and_after_resume(self):
    config = _config('cifar10')
    ds = registry.make_dataset(config)
    first = ds.train.read(np.arange(4), np.array([[0, 0, 0, 0], [2, 2, 2, 2], [4, 4, 4, 4]]), 2)
    # Abandoned micro-batches re-read (behind the stream), a jump ahead, then back behind the buffer.
    again = ds.train.read(np.arange(4), np.array([[2, 2, 2, 2]]), 2)
    np.testing.assert_array_equal(again['image'][0], first['image'][1])
    ds.train.read(np.arange(4), np.full((1, 4), 40), 2)
    back = ds.train.read(np.arange(4), np.zeros((1, 4), int), 2)
    np.testing.assert_array_equal(back['image'][0], first['image'][0])
    # A fresh pipeline (a resumed run) starting mid-stream, on a subset of workers (another host).
    fresh = registry.make_dataset(config)
    resumed = fresh.train.read(np.array([1, 3]), np.array([[4, 5]]), 1)
    np.testing.assert_array_equal(resumed['image'][0, 0, 0], first['image'][2, 1, 0])
    np.testing.assert_array_equal(resumed['image'][0, 1, 0], first['image'][2, 3, 1])
    np.testing.assert_array_equal(resumed['label'][0, 0, 0], first['label'][2, 1, 0])

  def test_augmentation_is_random_per_sample_and_seeded(self):
    plain = registry.make_dataset(_config('cifar10', augment=False)).train.read(np.arange(4), np.zeros((1, 4), int), 4)
    aug = registry.make_dataset(_config('cifar10')).train.read(np.arange(4), np.zeros((1, 4), int), 4)
    other_seed = registry.make_dataset(_config('cifar10', seed=1)).train.read(np.arange(4), np.zeros((1, 4), int), 4)
    self.assertFalse(np.allclose(plain['image'], aug['image']))
    self.assertFalse(np.array_equal(aug['image'], other_seed['image']))
    # Crops move the image by at most 4 pixels: pad + crop keep the example (and label) in place.
    np.testing.assert_array_equal(plain['label'], aug['label'])

  def test_microbatches_straddle_epochs_consistently(self):
    config = _config('cifar10', batch_size=5, microbatches=1)  # shard 12, micro-batch 5
    ds = registry.make_dataset(config)
    whole = ds.train.read(np.array([0]), np.array([[0]]), 6)['label'][0, 0].reshape(-1)
    parts = [registry.make_dataset(config).train.read(np.array([0]), np.array([[p]]), 1)['label'][0, 0, 0]
             for p in (2, 3)]
    np.testing.assert_array_equal(np.concatenate(parts), whole[10:20])

  @parameterized.parameters('cifar10', 'imagenet2012')
  def test_eval_batches_cover_the_split_once_with_padding_and_mask(self, name):
    ds = registry.make_dataset(_config(name))
    batches = list(ds.eval_batches(20))
    self.assertLen(batches, 3)
    for batch in batches:
      self.assertEqual(batch['image'].shape[0], 20)
      self.assertEqual(batch['mask'].shape, (20,))
    self.assertEqual(sum(b['mask'].sum() for b in batches), EXAMPLES)
    np.testing.assert_array_equal(batches[-1]['mask'], np.arange(20) < EXAMPLES - 40)
    self.assertTrue(np.all(batches[-1]['image'][EXAMPLES - 40:] == 0))

  def test_too_few_examples_for_the_workers_is_a_config_error(self):
    with self.assertRaisesRegex(errors.ConfigError, 'workers'):
      registry.make_dataset(_config('cifar10', workers=EXAMPLES + 1))


class MissingDatasetTest(parameterized.TestCase):

  @parameterized.parameters(('cifar10', 'tfds build cifar10 --data_dir='), ('cifar100', 'tfds build cifar100'),
                            ('imagenet2012', 'downloads/manual/'))
  def test_one_line_message_with_the_location_and_how_to_prepare(self, name, hint):
    data_dir = self.create_tempdir().full_path
    with self.assertRaises(errors.ConfigError) as raised:
      registry.make_dataset(_config(name, data_dir=data_dir))
    message = str(raised.exception)
    self.assertIsInstance(raised.exception, tfds_pipeline.DatasetNotFoundError)
    self.assertNotIn('\n', message)
    self.assertIn(data_dir, message)
    self.assertIn(hint, message)

  def test_unknown_tfds_name_is_a_config_error(self):
    with self.assertRaisesRegex(errors.ConfigError, 'dataset.tfds_name'):
      tfds_pipeline.builder('no_such_dataset_xyz', None)


class WaitlessIndexedImages(tfds.core.GeneratorBasedBuilder):
  """Testing only: 20 training images, image i filled with the value i."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(4, 4, 1)), 'label': tfds.features.ClassLabel(num_classes=10)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(20), 'test': self._generate_examples(7)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {'image': np.full((4, 4, 1), i, np.uint8), 'label': i % 10}


class RealFilesShardsTest(absltest.TestCase):
  """On prepared files (20 training examples), workers read their own `tfds.even_splits`."""

  def test_even_splits_are_disjoint_and_streams_are_deterministic(self):
    data_dir = self.create_tempdir().full_path
    builder = WaitlessIndexedImages(data_dir=data_dir)
    builder.download_and_prepare()
    shards = tfds_pipeline.Shards(builder, 'train', 3, data_dir)
    self.assertTrue(shards.reads_own_records)
    self.assertEqual((shards.size, shards.split_size), (6, 20))
    images = [np.stack([ex['image'] for ex in shards.source(w).as_numpy_iterator()]) for w in range(3)]
    prints = [set(_fingerprints(x)) for x in images]
    self.assertEqual([len(p) for p in prints], [6, 6, 6])
    self.assertLen(set.union(*prints), 18)

    preprocess = lambda ex, seed: {'image': tf.cast(ex['image'], tf.float32), 'label': ex['label']}
    make = lambda: tfds_pipeline.TfdsStreams(shards, preprocess, workers=3, microbatch_size=2, seed=0)
    a = make().read(np.arange(3), np.array([[0, 0, 0], [3, 3, 3]]), 3)
    b = make().read(np.arange(3), np.array([[3, 3, 3]]), 3)
    np.testing.assert_array_equal(a['image'][1], b['image'][0])
    self.assertEqual(set(_fingerprints(a['image'][0, 1].astype(np.uint8))), prints[1])
    self.assertNotEqual(a['image'][0, 1].reshape(6, -1)[:, 0].tolist(), sorted(a['image'][0, 1].reshape(6, -1)[:, 0]))


if __name__ == '__main__':
  absltest.main()
