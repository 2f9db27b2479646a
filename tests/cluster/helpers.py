"""Small builders shared by the cluster tests: a config with only the fields the clock reads."""

from __future__ import annotations

import json

import ml_collections
import numpy as np

from waitless.cluster import factory
from waitless.experiments.configs import common


def config(workers: int = 8, seed: int = 0, network: dict | None = None, **stragglers) -> ml_collections.ConfigDict:
  """`workers`, `seed`, the default `stragglers` / `network` / `cluster` sections (`configs/common.py`) with the
  given overrides."""
  c = ml_collections.ConfigDict()
  c.workers = workers
  c.seed = seed
  c.algorithm = ml_collections.ConfigDict({'name': 'test'})
  c.stragglers = common.stragglers_config()
  with c.stragglers.ignore_type():  # e.g. a tuple of failing workers where the default is one id
    for key, value in stragglers.items():
      c.stragglers[key] = value
  c.network = common.network_config()
  for key, value in (network or {}).items():
    c.network[key] = value
  c.cluster = common.cluster_config()
  return c


def clock(rule, workers: int = 8, model_bytes: float = 1e6, seed: int = 0, network: dict | None = None,
          **stragglers):
  return factory.make_clock(config(workers, seed, network, **stragglers), rule, model_bytes)


def json_round_trip(state):
  return json.loads(json.dumps(state))


def assert_blocks_equal(test, a, b, idle_fraction_rtol: float = 0.0):
  """Every field equal; `idle_fraction` up to rounding when two code paths divide differently."""
  test.assertIs(type(a.schedule), type(b.schedule))
  for key, x, y in zip(a.schedule._fields, a.schedule, b.schedule):
    np.testing.assert_array_equal(x, y, err_msg=key)
    test.assertEqual(x.dtype, y.dtype, key)
  for field in ('duration', 'sim_time', 'mean_staleness', 'bytes_communicated', 'idle'):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  np.testing.assert_allclose(a.idle_fraction, b.idle_fraction, rtol=idle_fraction_rtol, atol=0)
  test.assertEqual(sorted(a.measurements), sorted(b.measurements))
  for key in a.measurements:
    np.testing.assert_array_equal(a.measurements[key], b.measurements[key], err_msg=key)
