"""The embedded default data set: scikit-learn's 8x8 handwritten digits (ships with the package, no download).

1,797 images of 64 pixels, 10 classes. Fixed stratified split (20% test, split seed 0, independent of the run
seed), pixels scaled to [0, 1] then standardised with the training split's per-pixel mean and std.
"""

from __future__ import annotations

import numpy as np

from waitless.data import base
from waitless.data import in_memory

SPLIT_SEED = 0


def load_arrays(test_fraction: float = 0.2):
  """(train, test) dicts with `image` float32 (n, 64) and `label` int32 (n,)."""
  # scikit-learn only when the digits are loaded: importing it costs about 0.6 s that no other workload (nor a
  # Ray actor of another one) should pay.
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  digits = sk_datasets.load_digits()
  x = digits.data.astype(np.float32) / 16.0
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=test_fraction, random_state=SPLIT_SEED, stratify=y)
  # Border pixels are (nearly) constant in training; a floor on std keeps rare test values bounded.
  mean, std = x_train.mean(axis=0), np.maximum(x_train.std(axis=0), 0.1)
  x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
  return ({'image': x_train.astype(np.float32), 'label': y_train},
          {'image': x_test.astype(np.float32), 'label': y_test})


def make_dataset(config) -> base.Dataset:
  train, test = load_arrays(config.dataset.test_fraction)
  return in_memory.make_dataset(train, test, config, num_classes=10)
