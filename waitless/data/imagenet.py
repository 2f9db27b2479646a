"""ImageNet (ILSVRC 2012) from tensorflow-datasets (`imagenet2012`), streamed per worker.

ImageNet Large Scale Visual Recognition Challenge, Russakovsky et al., IJCV 2015. 1,281,167 training and
50,000 validation images, 1000 classes. Preprocessing as in flax `examples/imagenet` (Szegedy et al. 2015
"inception" crops): training takes a random crop of 8%-100% of the area and aspect ratio 3/4-4/3 (10 attempts,
else a center crop), resizes it to `image_size` (bicubic) and flips it at random, all stateless and seeded per
sample; evaluation takes the center crop of `image_size / (image_size + 32)` of the shorter side (= resize to
256, center crop 224) and resizes it. Pixels are normalised with the ImageNet mean and std. The JPEG bytes are
shuffled undecoded and only the crop window is decoded.

Prepare the data once: the images need a manual download (image-net.org): put ILSVRC2012_img_train.tar and
ILSVRC2012_img_val.tar in DIR/downloads/manual/, then `tfds build imagenet2012 --data_dir=DIR`.
"""

from __future__ import annotations

from etils import epy
import numpy as np

with epy.lazy_imports():
  # Imported on first use, so that importing the data registry stays cheap for the embedded data sets.
  import tensorflow as tf
  import tensorflow_datasets as tfds

from waitless.data import base
from waitless.data import tfds_pipeline

CROP_PADDING = 32
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _normalize(image):
  return (tf.cast(image, tf.float32) - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def _resize(image, image_size):
  return tf.image.resize([image], [image_size, image_size], method=tf.image.ResizeMethod.BICUBIC)[0]


def _center_crop(image_bytes, image_size):
  shape = tf.io.extract_jpeg_shape(image_bytes)
  height, width = shape[0], shape[1]
  crop = tf.cast((image_size / (image_size + CROP_PADDING)) *
                 tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
  offset_y = ((height - crop) + 1) // 2
  offset_x = ((width - crop) + 1) // 2
  window = tf.stack([offset_y, offset_x, crop, crop])
  return _resize(tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3), image_size)


def _random_crop(image_bytes, image_size, seed):
  shape = tf.io.extract_jpeg_shape(image_bytes)
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]), seed=seed,
      min_object_covered=0.1, aspect_ratio_range=(3. / 4., 4. / 3.), area_range=(0.08, 1.0),
      max_attempts=10, use_image_if_no_bounding_boxes=True)
  offset_y, offset_x, _ = tf.unstack(begin)
  height, width, _ = tf.unstack(size)
  window = tf.stack([offset_y, offset_x, height, width])
  image = tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3)
  # When no crop was found the whole image comes back: use the center crop then, as flax does.
  whole = tf.reduce_all(tf.equal(tf.shape(image)[:2], shape[:2]))
  return tf.cond(whole, lambda: _center_crop(image_bytes, image_size), lambda: _resize(image, image_size))


def train_preprocess(image_size: int, augment: bool = True):
  """(example, seed) -> {'image': float32 (size, size, 3), 'label': int32}: inception crop + flip."""

  def fn(example, seed):
    if augment:
      seeds = tf.random.experimental.stateless_split(seed, 2)
      image = _random_crop(example['image'], image_size, seeds[0])
      image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
    else:
      image = _center_crop(example['image'], image_size)
    image = tf.reshape(image, [image_size, image_size, 3])
    return {'image': _normalize(image), 'label': tf.cast(example['label'], tf.int32)}

  return fn


def eval_preprocess(image_size: int):

  def fn(example):
    image = tf.reshape(_center_crop(example['image'], image_size), [image_size, image_size, 3])
    return {'image': _normalize(image), 'label': tf.cast(example['label'], tf.int32)}

  return fn


NUM_CLASSES = 1000  # ILSVRC 2012's classes (tfds imagenet2012's `label` feature)


def signature(config) -> base.Signature:
  """The examples' shapes (`dataset.image_size`) and classes, without the data set's files."""
  image_size = config.dataset.get('image_size', 224)
  return base.Signature({'image': np.zeros((image_size, image_size, 3), np.float32), 'label': np.zeros((), np.int32)},
                        NUM_CLASSES)


def make_dataset(config) -> base.Dataset:
  """Reads `config.dataset.`: `data_dir`, `image_size`, `train_split`, `eval_split`, `shuffle_buffer`, `augment`."""
  d = config.dataset
  data_dir = d.get('data_dir')
  image_size = d.get('image_size', 224)
  decoders = {'image': tfds.decode.SkipDecoding()}
  ds_builder = tfds_pipeline.builder(d.get('tfds_name', 'imagenet2012'), data_dir)
  shards = tfds_pipeline.Shards(ds_builder, d.get('train_split', 'train'), config.workers, data_dir, decoders)
  streams = tfds_pipeline.TfdsStreams(
      shards, train_preprocess(image_size, d.get('augment', True)), workers=config.workers,
      microbatch_size=config.batch_size // config.microbatches, seed=config.seed,
      shuffle_buffer=d.get('shuffle_buffer', 2_048))
  # Built once, now: a missing split fails before training, and no tfds call runs during training.
  eval_ds = tfds_pipeline.as_dataset(ds_builder, d.get('eval_split', 'validation'), data_dir, decoders)
  eval_ds = eval_ds.map(eval_preprocess(image_size), num_parallel_calls=tfds_pipeline.AUTOTUNE)

  example = {'image': np.zeros((image_size, image_size, 3), np.float32), 'label': np.zeros((), np.int32)}
  return base.Dataset(
      train=streams, eval_batches=lambda batch_size: tfds_pipeline.eval_batches(eval_ds, batch_size),
      example=example, num_classes=ds_builder.info.features['label'].num_classes, train_size=shards.split_size)
