"""The embedded default data set: scikit-learn's 8x8 handwritten digits (ships with the package, no download).

1,797 images of 64 pixels, 10 classes. Fixed stratified split (20% test, split seed 0, independent of the run
seed), pixels scaled to [0, 1] then standardised with the training split's per-pixel mean and std.

The data file is read where scikit-learn installed it, without importing scikit-learn (whose import pulls in
scipy, for a 150 kB file), and the split is `sklearn.model_selection.train_test_split(x, y,
test_size=test_fraction, random_state=0, stratify=y)` computed here the way scikit-learn computes it (the same
indices, checked against scikit-learn itself in tests/data/test_embedded.py).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import os

import numpy as np

from waitless.data import base
from waitless.data import in_memory

SPLIT_SEED = 0


def data_file() -> str:
  """The path of scikit-learn's `digits.csv.gz` (what `sklearn.datasets.load_digits` reads)."""
  spec = importlib.util.find_spec('sklearn')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError('the digits data set ships with scikit-learn, which is not installed: '
                            'pip install scikit-learn (see requirements.txt)')
  for location in spec.submodule_search_locations:
    path = os.path.join(location, 'datasets', 'data', 'digits.csv.gz')
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f'scikit-learn at {list(spec.submodule_search_locations)} has no '
                          'datasets/data/digits.csv.gz: reinstall it (pip install --force-reinstall scikit-learn)')


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
  """Draws per class, proportional to `class_counts`, ties broken with `rng` (`sklearn.utils.extmath`)."""
  continuous = class_counts / class_counts.sum() * n_draws
  floored = np.floor(continuous)
  need_to_add = int(n_draws - floored.sum())
  if need_to_add > 0:
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
      (inds,) = np.where(remainder == value)
      add_now = min(len(inds), need_to_add)
      floored[rng.choice(inds, size=add_now, replace=False)] += 1
      need_to_add -= add_now
      if need_to_add == 0:
        break
  return floored.astype(int)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, test) indices of `train_test_split(..., test_size=test_fraction, random_state=seed, stratify=y)`.

  scikit-learn's `StratifiedShuffleSplit` draw, step for step: the same sizes, the same calls on a
  `RandomState(seed)` in the same order, so the same indices.
  """
  n_test = math.ceil(test_fraction * len(y))
  n_train = len(y) - n_test
  _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
  if class_counts.min() < 2 or min(n_train, n_test) < len(class_counts):
    raise ValueError(f'test_fraction={test_fraction} leaves a split with fewer examples than the '
                     f'{len(class_counts)} classes')
  class_indices = np.split(np.argsort(y_indices, kind='stable'), np.cumsum(class_counts)[:-1])
  rng = np.random.RandomState(seed)
  n_i = _approximate_mode(class_counts, n_train, rng)
  t_i = _approximate_mode(class_counts - n_i, n_test, rng)
  train, test = [], []
  for i, indices in enumerate(class_indices):
    shuffled = indices.take(rng.permutation(class_counts[i]), mode='clip')
    train.append(shuffled[:n_i[i]])
    test.append(shuffled[n_i[i]:n_i[i] + t_i[i]])
  return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


@functools.lru_cache(maxsize=4)
def load_arrays(test_fraction: float = 0.2):
  """(train, test) dicts with `image` float32 (n, 64) and `label` int32 (n,).

  Read and normalised once per `test_fraction` and shared (as `mnist1d.load_arrays`): the runs of one program
  (`--seeds`, sweeps) each build a dataset from them, and 4,818 replicas read the file 4,818 times (a minute)."""
  with gzip.open(data_file(), 'rt') as f:
    data = np.loadtxt(f, delimiter=',')
  x = data[:, :-1].astype(np.float32) / 16.0
  y = data[:, -1].astype(int).astype(np.int32)
  train, test = stratified_split(y, test_fraction, SPLIT_SEED)
  x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
  # Border pixels are (nearly) constant in training; a floor on std keeps rare test values bounded.
  mean, std = x_train.mean(axis=0), np.maximum(x_train.std(axis=0), 0.1)
  x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
  return ({'image': x_train.astype(np.float32), 'label': y_train},
          {'image': x_test.astype(np.float32), 'label': y_test})


def signature(config) -> base.Signature:
  """One example of the training split and the classes (no split over workers)."""
  train, _ = load_arrays(config.dataset.test_fraction)
  return base.Signature({k: v[0] for k, v in train.items()}, 10)


def make_dataset(config) -> base.Dataset:
  train, test = load_arrays(config.dataset.test_fraction)
  return in_memory.make_dataset(train, test, config, num_classes=10)
