"""MNIST-1D (Greydanus, "Scaling down deep learning", 2020), generated locally: no download.

5,000 sequences of length 40 made from ten 1-D digit templates by random padding, scaling, translation,
correlated and i.i.d. noise and shear (the `mnist1d` package's `make_dataset(get_dataset_args())`, its
default arguments and seed 42): the paper's fixed split of 4,000 training and 1,000 test sequences, already
standardised by the package (zero mean, unit std over the whole set). The split is independent of the run seed.

The package's download path (`get_dataset`, which fetches a pickle over HTTP) is never called. Generating takes
a few seconds (importing the package imports matplotlib and scipy), so the arrays are cached: in memory for the
process and as a `.npz` under `$WAITLESS_CACHE_DIR` (default `~/.cache/waitless`) named by the package version
(whose default arguments it uses; the file records them); a later process loads them without importing the
package. An unreadable cache file is generated again.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import random
import tempfile
import zipfile

import numpy as np

from waitless.data import base
from waitless.data import in_memory

CACHE_ENV = 'WAITLESS_CACHE_DIR'
NUM_CLASSES = 10
_KEYS = ('x_train', 'y_train', 'x_test', 'y_test', 'args')


def cache_dir() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser('~'), '.cache', 'waitless')


def _default_args() -> dict:
  from mnist1d import data as mnist1d_data
  args = mnist1d_data.get_dataset_args(as_dict=True)
  args.pop('url')  # the download address plays no part in generation
  return args


def _cache_path() -> str:
  # The package's defaults are fixed per version: another version gets another file.
  return os.path.join(cache_dir(), f'mnist1d-{importlib.metadata.version("mnist1d")}.npz')


def generate() -> dict[str, np.ndarray]:
  """Runs the package's generator (its defaults, seed 42) without touching the caller's global RNG state."""
  from mnist1d import data as mnist1d_data
  from mnist1d import utils as mnist1d_utils
  args = _default_args()
  np_state, py_state = np.random.get_state(), random.getstate()  # make_dataset reseeds both globally
  try:
    d = mnist1d_data.make_dataset(mnist1d_utils.ObjectView(args))
  finally:
    np.random.set_state(np_state)
    random.setstate(py_state)
  return {'x_train': d['x'].astype(np.float32), 'y_train': d['y'].astype(np.int32),
          'x_test': d['x_test'].astype(np.float32), 'y_test': d['y_test'].astype(np.int32),
          'args': np.array(json.dumps(args, sort_keys=True))}


@functools.lru_cache(maxsize=1)
def _cached() -> dict[str, np.ndarray]:
  path = _cache_path()
  if os.path.exists(path):
    try:
      with np.load(path) as f:
        return {k: f[k] for k in _KEYS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
      pass  # unreadable: generate it again and replace it
  arrays = generate()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.npz.tmp')
  with os.fdopen(fd, 'wb') as f:
    np.savez(f, **arrays)
  os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep it from other users
  os.replace(tmp, path)  # atomic: concurrent runs each write a whole file
  return arrays


def load_arrays():
  """(train, test) dicts with `image` float32 (n, 40) and `label` int32 (n,): 4,000 and 1,000 sequences."""
  a = _cached()
  return ({'image': a['x_train'], 'label': a['y_train']}, {'image': a['x_test'], 'label': a['y_test']})


def signature(config) -> base.Signature:
  """One example of the training split and the classes (no split over workers)."""
  train, _ = load_arrays()
  return base.Signature({k: v[0] for k, v in train.items()}, NUM_CLASSES)


def make_dataset(config) -> base.Dataset:
  train, test = load_arrays()
  return in_memory.make_dataset(train, test, config, num_classes=NUM_CLASSES)
