"""Small builders shared by the cluster tests: a config with only the fields the clock reads."""

from __future__ import annotations

import json

import ml_collections
import numpy as np

from cluster import factory


def config(workers: int = 8, seed: int = 0, network: dict | None = None, **stragglers) -> ml_collections.ConfigDict:
  """`workers`, `seed`, default `stragglers` / `network` sections with the given overrides."""
  c = ml_collections.ConfigDict()
  c.workers = workers
  c.seed = seed
  c.algorithm = ml_collections.ConfigDict({'name': 'test'})
  c.stragglers = factory.default_stragglers_config()
  with c.stragglers.ignore_type():  # e.g. a tuple of failing workers where the default is one id
    for key, value in stragglers.items():
      c.stragglers[key] = value
  c.network = factory.default_network_config()
  for key, value in (network or {}).items():
    c.network[key] = value
  return c


def clock(rule, workers: int = 8, model_bytes: float = 1e6, seed: int = 0, network: dict | None = None,
          **stragglers):
  return factory.make_clock(config(workers, seed, network, **stragglers), rule, model_bytes)


def json_round_trip(state):
  return json.loads(json.dumps(state))


def assert_blocks_equal(test, a, b, idle_fraction_rtol: float = 0.0):
  """Every field equal; `idle_fraction` up to rounding when two code paths divide differently."""
  test.assertEqual(sorted(a.schedule), sorted(b.schedule))
  for key in a.schedule:
    np.testing.assert_array_equal(a.schedule[key], b.schedule[key], err_msg=key)
    test.assertEqual(a.schedule[key].dtype, b.schedule[key].dtype, key)
  for field in ('duration', 'sim_time', 'mean_staleness', 'bytes_communicated', 'idle'):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  np.testing.assert_allclose(a.idle_fraction, b.idle_fraction, rtol=idle_fraction_rtol, atol=0)
  test.assertEqual(sorted(a.counters), sorted(b.counters))
  for key in a.counters:
    np.testing.assert_array_equal(a.counters[key], b.counters[key], err_msg=key)
