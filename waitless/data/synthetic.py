"""Synthetic problems with known structure, for exactness tests and quick experiments.

`least_squares`: y = x . w* + noise, x ~ N(0, I_d). `logistic`: label = 1[x . w* + noise > 0].
Generated from `dataset.problem_seed` (not the run seed), so runs with different seeds see the same problem.
"""

from __future__ import annotations

import numpy as np

from waitless.data import base
from waitless.data import in_memory

PROBLEMS = ('least_squares', 'logistic')


def make_arrays(problem: str, num_examples: int, dim: int, noise: float, seed: int):
  """(train, test) dicts: `image` float32 (n, dim) and `label` (float32 target or int32 class)."""
  rng = np.random.default_rng([seed, 7])
  w_star = rng.normal(size=dim) / np.sqrt(dim)
  x = rng.normal(size=(num_examples, dim)).astype(np.float32)
  z = x @ w_star + noise * rng.normal(size=num_examples)
  if problem == 'least_squares':
    y = z.astype(np.float32)
  elif problem == 'logistic':
    y = (z > 0).astype(np.int32)
  else:
    raise ValueError(f'dataset.problem={problem!r}; allowed: {", ".join(PROBLEMS)}')
  cut = int(0.8 * num_examples)
  return {'image': x[:cut], 'label': y[:cut]}, {'image': x[cut:], 'label': y[cut:]}


def signature(config) -> base.Signature:
  """The examples' shapes and the problem's outputs (1 for least squares, 2 classes for logistic)."""
  d = config.dataset
  regression = d.problem == 'least_squares'
  label = np.zeros((), np.float32 if regression else np.int32)
  return base.Signature({'image': np.zeros((d.dim,), np.float32), 'label': label}, 1 if regression else 2,
                        task='regression' if regression else 'classification')


def make_dataset(config) -> base.Dataset:
  d = config.dataset
  train, test = make_arrays(d.problem, d.num_examples, d.dim, d.noise, d.problem_seed)
  regression = d.problem == 'least_squares'
  return in_memory.make_dataset(train, test, config, num_classes=1 if regression else 2,
                                task='regression' if regression else 'classification')
