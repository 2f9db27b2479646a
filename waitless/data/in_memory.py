"""Per-worker streams over arrays held in host memory (the embedded and synthetic data sets).

Shards: the training examples are permuted once by the seed and cut into P equal, disjoint shards (the
remainder is dropped). Worker w's epoch e visits its shard in the order `permutation(seed, w, e)`.
"""

from __future__ import annotations

import numpy as np

from waitless import config_errors as errors
from waitless.data import base
from waitless.data import seed_sequences


class InMemoryStreams:
  """`base.WorkerStreams` over numpy arrays."""

  def __init__(self, arrays: base.Batch, workers: int, microbatch_size: int, seed: int):
    n = len(next(iter(arrays.values())))
    shard = n // workers
    errors.require(shard >= microbatch_size, 'workers', workers,
                   f'{n} training examples over {workers} workers leave {shard} per worker, fewer than one '
                   f'micro-batch of {microbatch_size} (batch_size / microbatches): use fewer workers or a smaller '
                   'batch_size')
    order = np.random.default_rng([seed, 1]).permutation(n)
    self.workers = workers
    self.microbatch_size = microbatch_size
    self.seed = seed
    self.shard_size = shard
    self._shards = order[:shard * workers].reshape(workers, shard)
    self._arrays = arrays
    self._epoch_tables: dict[int, np.ndarray] = {}

  def _epoch_orders(self, epochs: list[int]) -> np.ndarray:
    """(len(epochs), workers, shard): worker w's order of its shard in each epoch, `permutation(seed, w, e)`,
    the generators of every (epoch, worker) seeded at once (`seed_sequences`: `np.random.default_rng` of the
    words (seed, 2, w, e), the same stream). Words past 32 bits (a seed of 2^32 or more) take numpy's own
    seeding, one generator at a time."""
    words = [(self.seed, 2, w, e) for e in epochs for w in range(self.workers)]
    if all(0 <= x < 2**32 for x in (self.seed, self.workers - 1, max(epochs))):
      rngs = seed_sequences.generators(np.array(words, np.uint32))
    else:
      rngs = [np.random.default_rng(list(w)) for w in words]
    orders = np.stack([rng.permutation(self.shard_size) for rng in rngs])
    rows = np.tile(np.arange(self.workers), len(epochs))
    return self._shards[rows[:, None], orders].reshape(len(epochs), self.workers, self.shard_size)

  def _epoch_tables_of(self, epochs: list[int]) -> list[np.ndarray]:
    """The (workers, shard) order tables of `epochs` (see `_epoch_orders`), the missing ones made together and
    cached (see `_indices_of`)."""
    missing = [e for e in epochs if e not in self._epoch_tables]
    if missing:
      self._epoch_tables.update(zip(missing, self._epoch_orders(missing)))
    return [self._epoch_tables[e] for e in epochs]

  def indices(self, worker: int, first_sample: int, count: int) -> np.ndarray:
    """Example indices of samples first_sample .. first_sample+count-1 of `worker`'s stream."""
    return self._indices_of(np.asarray([worker]), np.arange(first_sample, first_sample + count)[:, None])[:, 0]

  def _indices_of(self, workers: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Example indices of stream positions `samples` (..., W), column j in the stream of `workers[j]`."""
    epochs, offsets = np.divmod(samples, self.shard_size)
    first, last = int(epochs.min()), int(epochs.max())
    if first == last:  # the usual read: one epoch
      needed, rows = [first], 0
    else:  # a read of several blocks at once spans several epochs: one gather from their tables stacked
      # A worker reads a run of its stream: the epochs from its first to its last (found per worker, without
      # sorting the read).
      per_worker = epochs.reshape(-1, epochs.shape[-1])
      needed = sorted(set().union(*(range(low, high + 1) for low, high in
                                    zip(per_worker.min(axis=0).tolist(), per_worker.max(axis=0).tolist()))))
      lookup = np.zeros(last - first + 1, np.intp)
      lookup[np.asarray(needed) - first] = np.arange(len(needed))
      rows = lookup[epochs - first]
    tables = self._epoch_tables_of(needed)
    if len(tables) == 1:
      out = tables[0][workers, offsets]
    else:  # tables[rows, workers, offsets], as one gather by one flat index in place of three index arrays
      out = np.stack(tables).ravel().take((rows * self.workers + workers) * self.shard_size + offsets)
    for epoch in set(self._epoch_tables) - set(needed):  # positions only grow: keep what this read used
      del self._epoch_tables[epoch]
    return out

  @property
  def resident(self) -> base.Batch:
    """The training arrays: small enough to live on every device (`base.WorkerStreams`)."""
    return self._arrays

  def read_indices(self, workers, positions, count):
    workers = np.asarray(workers)
    positions = np.asarray(positions, np.int64)
    n, w = positions.shape
    mb = self.microbatch_size
    samples = positions[:, :, None] * mb + np.arange(count * mb)  # (n, W, count * mb)
    idx = np.moveaxis(self._indices_of(workers, np.moveaxis(samples, 1, -1)), -1, 1)
    return idx.reshape((n, w, count, mb))

  def read(self, workers, positions, count):
    idx = self.read_indices(workers, positions, count)
    return {key: value[idx] for key, value in self._arrays.items()}


def make_dataset(train: base.Batch, test: base.Batch, config, num_classes: int,
                 task: str = 'classification') -> base.Dataset:
  """A `base.Dataset` of arrays in host memory: per-worker streams over `train`, padded eval batches of `test`."""
  streams = InMemoryStreams(train, workers=config.workers, microbatch_size=config.batch_size // config.microbatches,
                            seed=config.seed)
  return base.Dataset(
      train=streams, eval_batches=lambda batch_size: base.padded_batches(test, batch_size),
      example={k: v[0] for k, v in train.items()}, num_classes=num_classes, train_size=len(train['label']),
      task=task)
