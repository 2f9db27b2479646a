"""The data contract between input pipelines and the training loop.

Every worker reads its own disjoint shard of the training data, in an order that is a function of the seed
only. Positions are counted in micro-batches per worker: position p of worker w is the p-th micro-batch of w's
stream (epochs follow one another, each in a fresh seeded order). The loop asks for the micro-batches at
explicit positions, so a resumed run, or an algorithm that abandons a micro-batch and re-reads it next
iteration (non-blocking SGD), gets exactly the same samples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Protocol

import numpy as np

Batch = dict[str, np.ndarray]


class WorkerStreams(Protocol):
  """Per-worker training streams.

  A data set held in memory (`resident`, its arrays) may be kept on the devices by the step, which then reads
  its micro-batches by example index (`read_indices`) instead of receiving the examples; a streamed pipeline
  has `resident` None and is only `read`.
  """

  workers: int            # P, all workers of the run
  microbatch_size: int    # samples per micro-batch (= batch_size / microbatches)
  resident: Batch | None  # the training arrays (N, ...) when they are held in memory, else None

  def read(self, workers: np.ndarray, positions: np.ndarray, count: int) -> Batch:
    """Micro-batches `positions[k, j] .. positions[k, j] + count - 1` of worker `workers[j]`.

    Args:
      workers: int (w,) global worker ids this process feeds (all of them on one host).
      positions: int (n, w) first micro-batch position of each iteration and worker.
      count: micro-batches per iteration (m).

    Returns:
      Arrays of shape (n, w, count, microbatch_size, ...).
    """

  def read_indices(self, workers: np.ndarray, positions: np.ndarray, count: int) -> np.ndarray:
    """What `read` would return, as example indices into `resident`: int (n, w, count, microbatch_size).
    Only for a stream whose `resident` is not None."""


@dataclasses.dataclass(frozen=True)
class Signature:
  """What a model needs of a data set to be built and sized, without the data: `example` (one un-batched training
  example, zeros of its shapes and dtypes), `num_classes` and `task` (as in `Dataset`)."""
  example: Batch
  num_classes: int
  task: str = 'classification'


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A training stream per worker plus an evaluation split.

  Attributes:
    train: the per-worker training streams.
    eval_batches: callable(batch_size) -> iterator over dicts with the same keys as training batches plus
      `mask` (float32, 1 for real examples, 0 for padding), covering the evaluation split once.
    example: one un-batched training example (dict of arrays) to initialise models.
    num_classes: output classes (or vocabulary size for sequence tasks).
    train_size: examples in the training split.
    task: which loss `experiments/harness/tasks.py` applies: `classification`, `regression` (or `seq2seq`).
  """
  train: WorkerStreams
  eval_batches: Any
  example: Batch
  num_classes: int
  train_size: int
  task: str = 'classification'


def padded_batches(arrays: Batch, batch_size: int) -> Iterator[Batch]:
  """Fixed-shape batches over in-memory `arrays`, the last one padded and marked by `mask`."""
  n = len(next(iter(arrays.values())))
  for start in range(0, n, batch_size):
    stop = min(start + batch_size, n)
    batch = {}
    for key, value in arrays.items():
      chunk = value[start:stop]
      pad = batch_size - len(chunk)
      batch[key] = np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], chunk.dtype)]) if pad else chunk
    batch['mask'] = (np.arange(batch_size) < stop - start).astype(np.float32)
    yield batch
