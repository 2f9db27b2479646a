"""Per-worker streams over arrays held in host memory (the embedded and synthetic data sets).

Shards: the training examples are permuted once by the seed and cut into P equal, disjoint shards (the
remainder is dropped). Worker w's epoch e visits its shard in the order `permutation(seed, w, e)`.
"""

from __future__ import annotations

import numpy as np

from data import base


class InMemoryStreams:
  """`base.WorkerStreams` over numpy arrays."""

  def __init__(self, arrays: base.Batch, workers: int, microbatch_size: int, seed: int):
    n = len(next(iter(arrays.values())))
    shard = n // workers
    if shard < microbatch_size:
      raise ValueError(f'{n} training examples over {workers} workers leave {shard} per worker, fewer than '
                       f'one micro-batch of {microbatch_size}')
    order = np.random.default_rng([seed, 1]).permutation(n)
    self.workers = workers
    self.microbatch_size = microbatch_size
    self.seed = seed
    self.shard_size = shard
    self._shards = order[:shard * workers].reshape(workers, shard)
    self._arrays = arrays
    self._epoch_orders: dict[tuple[int, int], np.ndarray] = {}

  def _epoch_order(self, worker: int, epoch: int) -> np.ndarray:
    key = (worker, epoch)
    if key not in self._epoch_orders:
      if len(self._epoch_orders) > 4 * self.workers:
        self._epoch_orders.clear()
      rng = np.random.default_rng([self.seed, 2, worker, epoch])
      self._epoch_orders[key] = self._shards[worker][rng.permutation(self.shard_size)]
    return self._epoch_orders[key]

  def indices(self, worker: int, first_sample: int, count: int) -> np.ndarray:
    """Example indices of samples first_sample .. first_sample+count-1 of `worker`'s stream."""
    return self._indices_of(worker, np.arange(first_sample, first_sample + count))

  def _indices_of(self, worker: int, samples: np.ndarray) -> np.ndarray:
    """Example indices of `worker`'s stream positions `samples` (any shape)."""
    epochs, offsets = np.divmod(samples, self.shard_size)
    out = np.empty(samples.shape, np.int64)
    for epoch in np.unique(epochs):
      selected = epochs == epoch
      out[selected] = self._epoch_order(worker, int(epoch))[offsets[selected]]
    return out

  def read(self, workers, positions, count):
    workers = np.asarray(workers)
    positions = np.asarray(positions, np.int64)
    n, w = positions.shape
    mb = self.microbatch_size
    idx = np.empty((n, w, count * mb), np.int64)
    span = np.arange(count * mb)
    for j, worker in enumerate(workers):  # the whole block of one worker at once
      idx[:, j] = self._indices_of(int(worker), positions[:, j, None] * mb + span)
    return {key: value[idx].reshape((n, w, count, mb) + value.shape[1:]) for key, value in self._arrays.items()}


def make_dataset(train: base.Batch, test: base.Batch, config, num_classes: int,
                 task: str = 'classification') -> base.Dataset:
  """A `base.Dataset` of arrays in host memory: per-worker streams over `train`, padded eval batches of `test`."""
  streams = InMemoryStreams(train, workers=config.workers, microbatch_size=config.batch_size // config.microbatches,
                            seed=config.seed)
  return base.Dataset(
      train=streams, eval_batches=lambda batch_size: base.padded_batches(test, batch_size),
      example={k: v[0] for k, v in train.items()}, num_classes=num_classes, train_size=len(train['label']),
      task=task)
