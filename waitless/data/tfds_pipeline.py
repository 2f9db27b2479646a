"""Per-worker streams over tensorflow-datasets splits, read by micro-batch position (the `data.base` contract).

A tfds split is read sequentially from record files, so a position cannot be fetched directly. Each worker
gets its own deterministic tf.data pipeline instead, and the reader keeps it positioned:

- Shards: worker w of P reads `tfds.even_splits(split, P)[w]` (only its own records; n // P examples each).
  Worker ids are global, so the processes of a multi-host run (`jax.process_index()` of
  `jax.process_count()`) read disjoint shards by construction: a process only builds pipelines for the
  workers it feeds. Where the split sizes are unknown or do not match what the split yields (as under
  `tfds.testing.mock_data`), the full split is cut with `Dataset.shard(P, w)` instead (n // P each).
- Order: worker w's stream is its shard's epochs one after another; epoch e is the shard shuffled (window
  `shuffle_buffer`) with seed (seed, w, e). Sample s of the stream is epoch s // n_w, offset s % n_w.
- Augmentation: stateless random ops seeded with (seed, w, s), so a re-read micro-batch has identical pixels.
- Reading: the iterator of each worker keeps the last `keep` micro-batches it produced; a position inside that
  window is served from it, a position just ahead is reached by iterating, and a position behind the window or
  far ahead rebuilds the pipeline at that position (jump to the epoch, `skip` the offset: raw records only, no
  decoding). tf.data prefetches a few micro-batches ahead of the last one read.

Eval: `eval_batches(...)` covers the evaluation split once with fixed-shape, zero-padded batches and `mask`.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Iterator

from etils import epy
import numpy as np

with epy.lazy_imports():
  # Imported on first use, so that importing the data registry stays cheap for the embedded data sets.
  import tensorflow as tf
  import tensorflow_datasets as tfds

from waitless import config_errors as errors
from waitless.data import base

AUTOTUNE = -1  # tf.data.AUTOTUNE


class DatasetNotFoundError(errors.ConfigError):
  """A tfds data set is not prepared where tfds looks for it; the message says how to prepare it."""

  def __init__(self, message: str, data_dir):
    self.field, self.value, self.allowed = 'dataset.data_dir', data_dir, message
    ValueError.__init__(self, message)


def data_dir_root(data_dir: str | None) -> str:
  """Where tfds reads data sets from: `data_dir`, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  if data_dir:
    return os.fspath(data_dir)
  return os.environ.get('TFDS_DATA_DIR', os.path.expanduser('~/tensorflow_datasets'))


def prepare_hint(name: str, data_dir: str | None) -> str:
  root = data_dir_root(data_dir)
  base_name = name.split('/')[0].split(':')[0]
  if base_name == 'imagenet2012':
    return (f'download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar by hand (image-net.org) into '
            f'{root}/downloads/manual/, then run: tfds build imagenet2012 --data_dir={root}')
  return f'prepare it with: tfds build {name.split(":")[0]} --data_dir={root}'


def builder(name: str, data_dir: str | None):
  """The tfds builder of `name` (a ConfigError for a name tfds does not know)."""
  try:
    return tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise errors.ConfigError('dataset.tfds_name', name, 'tfds does not know this data set') from e


def as_dataset(ds_builder, split, data_dir: str | None, decoders=None) -> tf.data.Dataset:
  """`ds_builder.as_dataset(split)` in a fixed order; a DatasetNotFoundError if the data is not prepared."""
  try:
    return ds_builder.as_dataset(split=split, decoders=decoders, shuffle_files=False,
                                 read_config=tfds.ReadConfig(try_autocache=False))
  except (AssertionError, FileNotFoundError, tf.errors.NotFoundError) as e:
    raise DatasetNotFoundError(
        f'data set {ds_builder.name} not found in {data_dir_root(data_dir)} (tfds expects it in '
        f'{ds_builder.data_dir}); {prepare_hint(ds_builder.info.full_name.rsplit("/", 1)[0], data_dir)}',
        data_dir) from e


def count(ds: tf.data.Dataset) -> int:
  n = int(ds.cardinality())
  if n >= 0:
    return n
  return int(ds.reduce(np.int64(0), lambda c, _: c + 1))


class Shards:
  """The disjoint per-worker shards of one split: `source(w)` -> tf.data.Dataset, `size` examples each.

  Every worker's dataset object is created here, before training: `tfds.testing.mock_data` swaps the file
  system while `as_dataset` runs, which must not overlap the checkpointer's background writes.
  """

  def __init__(self, ds_builder, split: str, workers: int, data_dir: str | None, decoders=None):
    full = as_dataset(ds_builder, split, data_dir, decoders)
    yielded = int(full.cardinality())
    try:
      recorded = ds_builder.info.splits[split].num_examples if ds_builder.info.splits else None
    except (KeyError, ValueError):
      recorded = None
    self.workers = workers
    self.split_size = yielded if yielded >= 0 else None
    self.reads_own_records = bool(recorded and recorded == yielded)
    if self.reads_own_records:
      # Real files: every worker reads only its own records.
      self.split_size = recorded
      self.size = recorded // workers
    else:
      # Unknown sizes (mock data): cut the full split.
      if self.split_size is None:
        self.split_size = count(full)
      self.size = self.split_size // workers
    if self.size < 1:
      raise errors.ConfigError('workers', workers, f'{split} of {ds_builder.name} has {self.split_size} '
                               f'examples, fewer than one per worker')
    if self.reads_own_records:
      subsplits = tfds.even_splits(split, n=workers, drop_remainder=True)
      self._sources = [as_dataset(ds_builder, s, data_dir, decoders).take(self.size) for s in subsplits]
    else:
      full = full.take(self.size * workers)
      self._sources = [full.shard(workers, w) for w in range(workers)]

  def source(self, worker: int) -> tf.data.Dataset:
    return self._sources[worker]


def _mix(seed: int, *values: int) -> int:
  """A 31-bit seed from integers (stable across processes, unlike `hash`)."""
  return int(np.random.default_rng([seed, *values]).integers(0, 2 ** 31 - 1))


class TfdsStreams:
  """`base.WorkerStreams` over per-worker tf.data pipelines.

  Args:
    shards: the per-worker shards (raw, un-augmented examples in a fixed order).
    preprocess: (example, seed) -> dict of fixed-shape tensors; `seed` is an int64 (2,) tensor, unique per
      (run seed, worker, stream sample), to seed stateless random augmentation.
    workers: P. microbatch_size: samples per micro-batch. seed: the run seed.
    shuffle_buffer: shuffle window within each worker's shard (capped at the shard size).
    keep: micro-batches each worker keeps after reading them (re-reads of abandoned micro-batches).
    max_ahead: positions further ahead than this rebuild the pipeline with `skip` instead of iterating.
    prefetch: micro-batches tf.data prepares ahead of the reader.
  """
  resident = None  # streamed: the step receives the examples (`base.WorkerStreams`)

  def __init__(self, shards: Shards, preprocess: Callable[[Any, tf.Tensor], dict], workers: int,
               microbatch_size: int, seed: int, shuffle_buffer: int = 10_000, keep: int = 8,
               max_ahead: int = 8, prefetch: int = 2):
    self.workers = workers
    self.microbatch_size = microbatch_size
    self.seed = seed
    self.shard_size = shards.size
    self._shards = shards
    self._preprocess = preprocess
    self._shuffle_buffer = max(1, min(shuffle_buffer, shards.size))
    self._keep = keep
    self._max_ahead = max_ahead
    self._prefetch = prefetch
    self._iterators: dict[int, Iterator] = {}
    self._next: dict[int, int] = {}
    self._buffers: dict[int, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
    self.rebuilds = 0  # pipelines (re)built, for tests and diagnostics

  def pipeline(self, worker: int, position: int) -> tf.data.Dataset:
    """Worker `worker`'s micro-batches from `position` on."""
    shard = self._shards.source(worker)
    first = position * self.microbatch_size
    epoch, offset = divmod(first, self.shard_size)
    order_seed = np.int64(_mix(self.seed, 1, worker))
    augment_seed = np.int64(_mix(self.seed, 2, worker))
    buffer = self._shuffle_buffer

    def one_epoch(e):
      return shard.shuffle(buffer, seed=order_seed * 1_000_003 + e, reshuffle_each_iteration=False)

    ds = tf.data.Dataset.range(epoch, 2 ** 40).flat_map(one_epoch).skip(offset)
    ds = ds.enumerate(start=first)
    ds = ds.map(lambda s, ex: self._preprocess(ex, tf.stack([augment_seed, s])),
                num_parallel_calls=AUTOTUNE, deterministic=True)
    ds = ds.batch(self.microbatch_size, drop_remainder=True).prefetch(self._prefetch)
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options)

  def _microbatch(self, worker: int, position: int) -> dict:
    buffer = self._buffers[worker]
    if position in buffer:
      return buffer[position]
    nxt = self._next.get(worker)
    if nxt is None or position < nxt or position > nxt + self._max_ahead:
      self._iterators[worker] = self.pipeline(worker, position).as_numpy_iterator()
      self._next[worker] = nxt = position
      buffer.clear()
      self.rebuilds += 1
    iterator = self._iterators[worker]
    while nxt <= position:
      buffer[nxt] = next(iterator)
      nxt += 1
      while len(buffer) > self._keep:
        buffer.popitem(last=False)
    self._next[worker] = nxt
    return buffer[position]

  def read(self, workers, positions, count):
    workers = np.asarray(workers)
    positions = np.asarray(positions)
    self._keep = max(self._keep, 2 * count)
    n, w = positions.shape
    rows = [[[self._microbatch(int(workers[j]), int(positions[k, j]) + i) for i in range(count)]
             for j in range(w)] for k in range(n)]
    first = rows[0][0][0]
    return {key: np.stack([np.stack([np.stack([mb[key] for mb in row]) for row in per_k]) for per_k in rows])
            for key in first}


def eval_batches(ds: tf.data.Dataset, batch_size: int) -> Iterator[base.Batch]:
  """Fixed-shape batches over a preprocessed evaluation `ds`, the last one zero-padded; `mask` marks real ones."""
  for batch in ds.batch(batch_size).prefetch(2).as_numpy_iterator():
    size = len(next(iter(batch.values())))
    pad = batch_size - size
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
    batch['mask'] = (np.arange(batch_size) < size).astype(np.float32)
    yield batch
