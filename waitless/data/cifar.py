"""CIFAR-10 and CIFAR-100 from tensorflow-datasets (`cifar10`, `cifar100`), streamed per worker.

Learning Multiple Layers of Features from Tiny Images, Krizhevsky, 2009. 50,000 training and 10,000 test
images of 32x32x3. Training augmentation as in He et al. 2016 (arXiv:1512.03385): zero-pad 4 pixels, random
32x32 crop, random horizontal flip (stateless, seeded per sample: see `data/tfds_pipeline.py`); every image is
normalised with the training set's per-channel mean and std.

Prepare the data once (network needed): `tfds build cifar10 --data_dir=DIR` (or leave `dataset.data_dir`
None for tfds's default, $TFDS_DATA_DIR or ~/tensorflow_datasets).
"""

from __future__ import annotations

from etils import epy
import numpy as np

with epy.lazy_imports():
  import tensorflow as tf

from waitless.data import base
from waitless.data import tfds_pipeline

# Per-channel statistics of the training images (pixel values in [0, 1]).
STATS = {
    'cifar10': ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    'cifar100': ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
NUM_CLASSES = {'cifar10': 10, 'cifar100': 100}
IMAGE_SHAPE = (32, 32, 3)


def _normalize(image, name):
  mean, std = STATS[name]
  return (tf.cast(image, tf.float32) / 255.0 - tf.constant(mean)) / tf.constant(std)


def train_preprocess(name: str, augment: bool = True, pad: int = 4):
  """(example, seed) -> {'image': float32 (32, 32, 3), 'label': int32}: pad + crop + flip, normalise."""

  def fn(example, seed):
    image = example['image']
    if augment:
      seeds = tf.random.experimental.stateless_split(seed, 2)
      image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
      image = tf.image.stateless_random_crop(image, IMAGE_SHAPE, seed=seeds[0])
      image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
    return {'image': _normalize(image, name), 'label': tf.cast(example['label'], tf.int32)}

  return fn


def eval_preprocess(name: str):

  def fn(example):
    return {'image': _normalize(example['image'], name), 'label': tf.cast(example['label'], tf.int32)}

  return fn


def signature(config) -> base.Signature:
  """The examples' shapes and classes of `config.dataset.name`, without its files."""
  return base.Signature({'image': np.zeros(IMAGE_SHAPE, np.float32), 'label': np.zeros((), np.int32)},
                        NUM_CLASSES[config.dataset.name])


def make_dataset(config) -> base.Dataset:
  """`config.dataset.name` is `cifar10` or `cifar100`; reads `data_dir`, `train_split`, `eval_split`,
  `shuffle_buffer`, `augment`."""
  d = config.dataset
  name = d.name
  ds_builder = tfds_pipeline.builder(name, d.get('data_dir'))
  shards = tfds_pipeline.Shards(ds_builder, d.get('train_split', 'train'), config.workers, d.get('data_dir'))
  streams = tfds_pipeline.TfdsStreams(
      shards, train_preprocess(name, d.get('augment', True)), workers=config.workers,
      microbatch_size=config.batch_size // config.microbatches, seed=config.seed,
      shuffle_buffer=d.get('shuffle_buffer', 10_000))
  # Built once, now: a missing split fails before training, and no tfds call runs during training.
  eval_ds = tfds_pipeline.as_dataset(ds_builder, d.get('eval_split', 'test'), d.get('data_dir'))
  eval_ds = eval_ds.map(eval_preprocess(name), num_parallel_calls=tfds_pipeline.AUTOTUNE)

  example = {'image': np.zeros(IMAGE_SHAPE, np.float32), 'label': np.zeros((), np.int32)}
  return base.Dataset(
      train=streams, eval_batches=lambda batch_size: tfds_pipeline.eval_batches(eval_ds, batch_size),
      example=example, num_classes=NUM_CLASSES[name], train_size=shards.split_size)
